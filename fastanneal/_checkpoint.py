"""Checkpoints of the annealing state (``AnnealedKMeans(checkpoint=...)``).

The engine hands its :class:`~fastanneal._engine.AnnealState` to :class:`Checkpoint` at every
step boundary; the state is written atomically as one ``.npz`` (arrays) with a JSON header
(everything else: step, temperatures, the random generator's state, the schedule's state,
the trace so far). A rerun with the same data and parameters loads it (``allow_pickle=False``),
checks it -- version, checksum, the key of the data and parameters, shapes, finite values --
and resumes from it, so that it returns the same centers as an uninterrupted fit. A file that fails the
checks is named in an :class:`CheckpointWarning` and ignored (the fit starts over); a file
for other data or parameters is replaced. After the fit the file holds the finished state
(``phase == "done"``): a rerun then only recomputes the labels.
"""
import hashlib
import json
import math
import os
import warnings
import zipfile
from pathlib import Path

import numpy as np

from ._engine import AnnealState, Unsaveable
from ._io import atomic_save_npz

#: 3 (December 2026): the annealing rule's final state kept after its phase, the generator's
#: state after the re-allocation moves, schedule state with its types: a file of version 2
#: resumed some fits (mini-batch in its polish, n_init after a finished run) to other
#: results, so it is a bad file now (a warning, and the fit starts over).
#: 4: a checksum of the whole content (a hand-edited or damaged field -- a schedule state
#: of the wrong type, a phase, a seed -- crashed deep in the fit or was taken silently).
VERSION = 4
FILE_NAME = "anneal.npz"


def _digest(meta_text, arrays):
    """SHA-256 of a checkpoint's JSON header and arrays (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(k for k in arrays if k not in ("meta", "checksum")):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class CheckpointWarning(UserWarning):
    """A checkpoint file could not be used (named in the message); the fit starts over."""


def params_key(data_key, params):
    """Key of the data and the parameters that decide a fit's result."""
    h = hashlib.sha256()
    h.update(data_key.encode())
    h.update(json.dumps(params, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def resolve_path(path):
    """``PATH.npz`` is the file; any other path is a folder holding ``anneal.npz`` (an
    existing file there is an error when the fit sets up its checkpoint, not at the first
    save)."""
    p = Path(os.fspath(path))
    if p.suffix == ".npz":
        if p.is_dir():
            raise ValueError(f"checkpoint={os.fspath(path)!r} is a folder; a checkpoint file "
                             "ends in .npz")
        return p
    if p.exists() and not p.is_dir():
        raise ValueError(f"checkpoint={os.fspath(path)!r} is an existing file: give a folder "
                         "(it will hold anneal.npz) or a path ending in .npz")
    return p / FILE_NAME


class Checkpoint:
    """Save / load :class:`AnnealState` for one fit (``key``: :func:`params_key`)."""

    def __init__(self, path, key, n_clusters, n_features, extra=None, required_extra=()):
        self.path = resolve_path(path)
        self.key = key
        self.K = int(n_clusters)
        self.D = int(n_features)
        self.extra = dict(extra or {})     # estimator values to restore (T_c, ...)
        self.required_extra = tuple(required_extra)   # (finite numbers, checked on load)
        self.saved = 0
        self.trace = None
        #: set by :meth:`load`: the file held another fit's state (other data or
        #: parameters), which this fit's first save replaces
        self.replaced = False

    # ------------------------------------------------------------------ save
    def save(self, st):
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"centers": np.asarray(st.centers, dtype=np.float64)}
        if st.log_masses is not None:
            arrays["log_masses"] = np.asarray(st.log_masses, dtype=np.float64)
        rule_json, arule_json = {}, {}
        for prefix, state, js in (("rule_", st.rule_state, rule_json),
                                  ("arule_", st.anneal_rule_state, arule_json)):
            for k, v in state.items():
                if isinstance(v, np.ndarray):
                    arrays[f"{prefix}{k}"] = np.asarray(v, dtype=np.float64)
                else:
                    js[k] = v
        rows = self.trace._rows if self.trace is not None else []
        meta = dict(version=VERSION, key=self.key, phase=st.phase, step=st.step,
                    phase_step0=st.phase_step0, temperature=st.temperature, T_start=st.T_start,
                    T_end=st.T_end, scale=st.scale, n_iter=st.n_iter,
                    relocations=st.relocations, rng_state=st.rng_state,
                    schedule_state=st.schedule_state, rule_json=rule_json,
                    arule_json=arule_json, last=st.last,
                    converged=st.converged, extra=self.extra, trace=rows)
        text = json.dumps(meta, default=_json_default)
        arrays["checksum"] = np.array(_digest(text, arrays))
        arrays["meta"] = np.array(text)
        atomic_save_npz(self.path, **arrays)
        self.saved += 1

    # ------------------------------------------------------------------ load
    def load(self):
        """The saved :class:`AnnealState` (with ``.trace_rows`` and ``.extra``), or None
        (no file, another fit's file, or a bad file -- the latter with a warning)."""
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
            text = str(data.pop("meta"))
            checksum = str(data.pop("checksum", ""))
            meta = json.loads(text)
        except (OSError, ValueError, KeyError, EOFError, TypeError, AttributeError,
                zipfile.BadZipFile) as e:
            # (a .npy file, for which np.load returns an array, not an archive: `with` on it
            # is a TypeError from Python 3.11, an AttributeError before)
            # (numpy's own text for a non-zip file offers to load it "unsafely": not that)
            return self._bad(f"not a fastanneal checkpoint (.npz) or damaged "
                             f"({type(e).__name__})")
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            return self._bad("written by another version of fastanneal")
        if checksum != _digest(text, data):
            return self._bad("its content does not match its checksum (edited or damaged)")
        if meta.get("key") != self.key:
            self.replaced = True            # another fit's checkpoint: replaced by this one
            return None
        try:
            st = self._state(meta, data)
        except (KeyError, TypeError, ValueError) as e:
            return self._bad(str(e))
        return st

    def _state(self, meta, data):
        C = np.asarray(data["centers"])
        phase = meta["phase"]
        if phase not in ("critical", "anneal", "polish", "reallocate", "done"):
            raise ValueError(f"unknown phase {phase!r}")
        K_ok = C.shape[0] <= self.K if phase == "critical" else C.shape[0] == self.K
        if C.ndim != 2 or C.shape[1] != self.D or not K_ok:
            raise ValueError(f"centers of shape {C.shape} do not fit n_clusters={self.K}, "
                             f"{self.D} features")
        if C.dtype != np.float64 or not np.isfinite(C).all():
            raise ValueError("the centers contain NaN or infinity")
        lm = data.get("log_masses")
        if lm is not None and (lm.shape != (C.shape[0],) or np.isnan(lm).any()):
            raise ValueError("bad log masses")
        rule = dict(meta["rule_json"])
        arule = dict(meta.get("arule_json") or {})
        for k, v in data.items():
            for prefix, into in (("rule_", rule), ("arule_", arule)):
                if k.startswith(prefix):
                    if not np.isfinite(v).all():
                        raise ValueError(f"{k} contains NaN or infinity")
                    into[k[len(prefix):]] = v
        T = meta["temperature"]
        if T is not None and not (isinstance(T, (int, float)) and not isinstance(T, bool)
                                  and math.isfinite(T) and T > 0):
            raise ValueError(f"bad temperature {T!r}")
        if T is None and phase in ("critical", "anneal"):
            raise ValueError(f"no temperature in phase {phase!r}")
        for name in ("T_start", "T_end", "scale"):
            v = meta[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
                    or not math.isfinite(v):
                raise ValueError(f"bad {name} {v!r}")
        for name in ("step", "phase_step0", "n_iter", "relocations"):
            v = meta[name]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2 ** 53:
                raise ValueError(f"bad {name} {v!r}")
        if not isinstance(meta["schedule_state"], dict):
            raise ValueError("bad schedule state")
        if not isinstance(meta["last"], dict) or not isinstance(meta["converged"], bool):
            raise ValueError("bad last-pass values")
        if not isinstance(meta["rule_json"], dict) or not isinstance(
                meta.get("arule_json") or {}, dict):
            raise ValueError("bad rule state")
        _check_rng_state(meta["rng_state"])
        extra = meta["extra"]
        if not isinstance(extra, dict):
            raise ValueError("bad extra values")
        for name in self.required_extra:
            v = extra.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"bad or missing {name} {v!r}")
        trace = meta["trace"]
        if not isinstance(trace, list) or not all(isinstance(r, dict) for r in trace):
            raise ValueError("bad trace records")
        st = AnnealState(centers=C.copy(), temperature=T, T_start=float(meta["T_start"]),
                         T_end=float(meta["T_end"]), scale=float(meta["scale"]),
                         log_masses=None if lm is None else lm.copy(), phase=phase,
                         step=int(meta["step"]), phase_step0=int(meta["phase_step0"]),
                         n_iter=int(meta["n_iter"]), relocations=int(meta["relocations"]),
                         rng_state=meta["rng_state"], schedule_state=meta["schedule_state"],
                         rule_state=rule, last=dict(meta["last"]),
                         converged=bool(meta["converged"]), anneal_rule_state=arule)
        st.trace_rows = list(meta["trace"])
        st.extra = dict(meta["extra"])
        return st

    def _bad(self, why):
        warnings.warn(f"ignoring the checkpoint {self.path}: {why}; the fit starts over",
                      CheckpointWarning, stacklevel=4)
        return None


def _check_rng_state(state):
    """``ValueError`` unless ``state`` is a state NumPy's named bit generator accepts."""
    name = state.get("bit_generator") if isinstance(state, dict) else None
    bg = getattr(np.random, name, None) if isinstance(name, str) else None
    if not (isinstance(bg, type) and issubclass(bg, np.random.BitGenerator)):
        raise ValueError("bad random generator state")
    try:
        bg().state = state
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"bad random generator state ({e})") from None


def _json_default(v):
    if isinstance(v, Unsaveable):
        raise TypeError(v.message)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"cannot store {type(v).__name__} in a checkpoint")
