"""Checkpoints and resume (``AnnealedKMeans(checkpoint=...)``, ``MiniBatchAnnealedKMeans``).

* A process killed with SIGKILL mid-fit (in memory, and on a 2-process Dask LocalCluster)
  and rerun returns the centers of an uninterrupted run; the rerun resumes from the saved
  step.
* In process: a fit interrupted right after the checkpoint of step 3 (``Checkpoint.save``
  wrapped to raise KeyboardInterrupt) and rerun equals an uninterrupted fit -- centers,
  labels, inertia and the trace -- for the geometric, critical and adaptive schedules, the
  gradient solver and mini-batch annealing of a NumPy array; also after the critical
  phase has ended and inside the re-allocation phase that follows the polish.
* A finished checkpoint is reused (no annealing); one of another fit is replaced silently.
* Bad files (garbage bytes, NaN or wrongly shaped centers, another version, a pickled
  array) give a ``CheckpointWarning`` naming the file and the fit starts over.
* Mini-batch annealing of a NumPy array starts no Dask cluster.

All data come from fixed seeds.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import fastanneal as fa
from fastanneal import _checkpoint
from fastanneal import _engine
from fastanneal._checkpoint import CheckpointWarning

REPO = Path(__file__).resolve().parents[1]
STOP_STEP = 3


from conftest import blobs, require_cuda  # noqa: E402  (shared with test_dask.py)


@pytest.fixture(scope="module")
def data():
    X, _ = blobs(1500, 5, 6, seed=1)
    return X


def read_meta(path):
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def fit_without_bad_file_warning(est, X):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        return est.fit(X)


def interrupt_after(monkeypatch, stop_here):
    """Make ``Checkpoint.save`` raise KeyboardInterrupt right after it has written a state
    for which ``stop_here(st)`` is true; returns the list of (phase, step) saved."""
    real = _checkpoint.Checkpoint.save
    saved = []

    def save(self, st):
        real(self, st)
        saved.append((st.phase, st.step))
        if stop_here(st):
            raise KeyboardInterrupt(f"test interruption after {st.phase} step {st.step}")
    monkeypatch.setattr(_checkpoint.Checkpoint, "save", save)
    return saved


def interrupt_after_step(monkeypatch, stop=STOP_STEP):
    """Interrupt right after the checkpoint of step ``stop`` (its first save)."""
    return interrupt_after(monkeypatch, lambda st: st.step == stop and st.phase != "done")


def assert_same_fit(a, b, exact=True):
    """Everything a resumed fit must repeat of the uninterrupted one."""
    if exact:
        assert_array_equal(a.cluster_centers_, b.cluster_centers_)
        assert a.inertia_ == b.inertia_
        assert a.temperature_ == b.temperature_
    else:
        np.testing.assert_allclose(a.cluster_centers_, b.cluster_centers_, rtol=1e-12,
                                   atol=1e-12 * np.abs(b.cluster_centers_).max())
        assert a.inertia_ == pytest.approx(b.inertia_, rel=1e-12)
    assert_array_equal(a.labels_, b.labels_)
    assert a.n_iter_ == b.n_iter_ and a.n_steps_ == b.n_steps_
    ta, tb = a.trace_, b.trace_
    assert len(ta) == len(tb)
    assert list(ta["step"]) == list(tb["step"])
    np.testing.assert_allclose(ta["temperature"], tb["temperature"], rtol=1e-12)
    np.testing.assert_allclose(ta["hard_distortion"], tb["hard_distortion"], rtol=1e-12)


# ============================================================================ kill -9
SCRIPT = r'''
import json
import sys

import numpy as np


def data():
    g = np.random.default_rng(20240611)
    centers = g.normal(0.0, 5.0, (6, 8))
    y = g.integers(0, 6, {n})
    return centers[y] + g.normal(0.0, 1.0, ({n}, 8))


def main():
    mode, ck, out = sys.argv[1], sys.argv[2], sys.argv[3]
    import fastanneal as fa
    X = data()
    # every temperature (these blobs are hard from the first one): the test kills mid-schedule
    kw = dict(random_state=0, n_steps=12, checkpoint=ck, stop_when_hard=False)
    if mode == "dask":
        import dask.array as da
        import distributed
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           dashboard_address=None)
        client = distributed.Client(cluster)
        try:
            est = fa.AnnealedKMeans(6, backend="dask", scheduler=client, **kw).fit(
                da.from_array(X, chunks=(700, -1)))
        finally:
            client.close()
            cluster.close()
    else:
        est = fa.AnnealedKMeans(6, **kw).fit(X)
    with open(out + ".json", "w") as f:
        json.dump(est.checkpoint_info_, f)
    np.save(out + ".npy", est.cluster_centers_)


if __name__ == "__main__":
    main()
'''


def _env(delay=None):
    env = {k: v for k, v in os.environ.items() if k != _engine.STEP_DELAY_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if delay is not None:
        env[_engine.STEP_DELAY_ENV] = str(delay)
    return env


def _run_script(script, mode, ck, out, timeout):
    p = subprocess.run([sys.executable, str(script), mode, str(ck), str(out)], env=_env(),
                       cwd=script.parent, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(f"{out}.json") as f:
        info = json.load(f)
    return np.load(f"{out}.npy"), info


def _descendants(pid):
    try:
        import psutil
        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _reap(procs):
    """Wait for the processes the killed script had started (Dask nannies and workers exit
    once their parent is gone); kill, by pid, any that is still there."""
    if not procs:
        return []
    import psutil
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return alive


def kill_resume_roundtrip(tmp_path, mode, n, timeout):
    script = tmp_path / "fit_script.py"
    script.write_text(SCRIPT.replace("{n}", str(n)))
    # reference: uninterrupted, its own checkpoint folder
    ref_centers, ref_info = _run_script(script, mode, tmp_path / "ck_ref", tmp_path / "ref",
                                        timeout)
    assert ref_info["finished"] is False and ref_info["resumed_from"] is None
    ck = tmp_path / "ck"
    state = ck / "anneal.npz"
    out = tmp_path / "res"
    p = subprocess.Popen([sys.executable, str(script), mode, str(ck), str(out)],
                         env=_env(delay=0.3), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    children = []
    try:
        deadline = time.monotonic() + timeout
        step = -1
        while time.monotonic() < deadline and p.poll() is None:
            if state.exists():
                step = read_meta(state)["step"]
                if step >= STOP_STEP:
                    break
            time.sleep(0.02)
        children = _descendants(p.pid)
        assert p.poll() is None, ("the run ended before it could be killed:\n"
                                  + p.stderr.read().decode()[-3000:])
        assert step >= STOP_STEP, "no checkpoint of step 3 appeared in time"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
        _reap(children)
    assert p.returncode == -signal.SIGKILL
    assert not Path(f"{out}.npy").exists() and not Path(f"{out}.json").exists()
    meta = read_meta(state)          # the last complete state, readable without pickle
    assert meta["phase"] in ("anneal", "critical") and meta["step"] >= STOP_STEP
    killed_at = meta["step"]
    centers, info = _run_script(script, mode, ck, out, timeout)
    assert info["resumed_from"] == killed_at
    assert info["finished"] is False
    assert info["path"] == str(state)
    assert read_meta(state)["phase"] == "done"
    return centers, ref_centers


def test_sigkill_in_memory_then_resume(tmp_path):
    centers, ref = kill_resume_roundtrip(tmp_path, "memory", 3000, timeout=120)
    assert_array_equal(centers, ref)


@pytest.mark.dask
def test_sigkill_dask_then_resume(tmp_path):
    pytest.importorskip("dask.array")
    pytest.importorskip("distributed")
    centers, ref = kill_resume_roundtrip(tmp_path, "dask", 2100, timeout=150)
    np.testing.assert_allclose(centers, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


# ============================================================================ in process
CASES = {
    # stop_when_hard=False: the tests interrupt the schedule mid-way, and these blobs are hard
    # from the first temperature or settle after a few steps (the early ends are resumed in
    # test_stop_when_hard.py)
    "geometric": lambda ck: fa.AnnealedKMeans(5, random_state=0, n_steps=8, checkpoint=ck,
                                              stop_when_hard=False),
    "critical": lambda ck: fa.AnnealedKMeans(5, random_state=0, n_steps=8,
                                             schedule="critical", checkpoint=ck),
    "adaptive": lambda ck: fa.AnnealedKMeans(5, random_state=0, n_steps=8,
                                             schedule="adaptive", checkpoint=ck,
                                             stop_when_hard=False),
    "gradient": lambda ck: fa.AnnealedKMeans(5, random_state=0, n_steps=8, solver="gradient",
                                             gradient_steps=5, checkpoint=ck),
    "minibatch": lambda ck: fa.MiniBatchAnnealedKMeans(5, random_state=0, n_steps=8,
                                                       batch_size=200, checkpoint=ck),
    "minibatch-adaptive": lambda ck: fa.MiniBatchAnnealedKMeans(
        5, random_state=0, n_steps=8, batch_size=200, schedule="adaptive", checkpoint=ck),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_fit_resumes_to_the_same_result(case, data, tmp_path, monkeypatch):
    make = CASES[case]
    ref = make(None).fit(data)
    ck = tmp_path / "ck"
    saved = interrupt_after_step(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        make(ck).fit(data)
    monkeypatch.undo()
    assert saved[-1][1] == STOP_STEP and len(saved) == STOP_STEP
    state = ck / "anneal.npz"
    meta = read_meta(state)
    assert meta["step"] == STOP_STEP and meta["phase"] != "done"
    assert len(meta["trace"]) == STOP_STEP
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)   # the file is ours: no warning
        est = make(ck).fit(data)
    assert est.checkpoint_info_["resumed_from"] == STOP_STEP
    assert est.checkpoint_info_["finished"] is False
    assert est.checkpoint_info_["path"] == str(state)
    assert est.checkpoint_info_["temperature"] == meta["temperature"]
    assert_same_fit(est, ref)
    # the first records are those of the interrupted run, read back from the file
    assert list(est.trace_["wall_time"][:STOP_STEP]) == [r["wall_time"] for r in meta["trace"]]
    assert read_meta(state)["phase"] == "done"


def test_critical_resume_after_the_phase_change(data, tmp_path, monkeypatch):
    """Interrupted once all clusters have split (the last critical steps, the one-step anneal
    phase and the polish are all resumable)."""
    make = CASES["critical"]
    ref = make(None).fit(data)
    phases = {}
    real = _checkpoint.Checkpoint.save

    def record(self, st):
        real(self, st)
        phases.setdefault(st.step, st.phase)
    monkeypatch.setattr(_checkpoint.Checkpoint, "save", record)
    make(tmp_path / "all").fit(data)
    monkeypatch.undo()
    anneal_step = min(s for s, ph in phases.items() if ph == "anneal")
    polish_step = min(s for s, ph in phases.items() if ph == "polish")
    for stop in (anneal_step, polish_step):
        ck = tmp_path / f"ck{stop}"
        interrupt_after_step(monkeypatch, stop)
        with pytest.raises(KeyboardInterrupt):
            make(ck).fit(data)
        monkeypatch.undo()
        est = fit_without_bad_file_warning(make(ck), data)
        assert est.checkpoint_info_["resumed_from"] == stop
        assert_same_fit(est, ref)


def test_resume_inside_the_reallocation_phase(tmp_path, monkeypatch):
    """8 centers for 5 blobs: the re-allocation after the polish moves a codevector; a fit
    interrupted after that move was saved resumes to the uninterrupted result."""
    X, _ = blobs(1500, 5, 6, seed=1)
    make = lambda ck: fa.AnnealedKMeans(8, random_state=0, n_steps=8, reallocate=True,  # noqa
                                        checkpoint=ck)
    ref = make(None).fit(X)
    ck = tmp_path / "ck"
    saved = interrupt_after(monkeypatch, lambda st: st.phase == "reallocate"
                            and st.rule_state.get("moves", 0) >= 1)
    with pytest.raises(KeyboardInterrupt):
        make(ck).fit(X)
    monkeypatch.undo()
    assert saved[-1][0] == "reallocate"
    meta = read_meta(ck / "anneal.npz")
    assert meta["phase"] == "reallocate"
    est = fit_without_bad_file_warning(make(ck), X)
    assert est.checkpoint_info_["resumed_from"] == meta["step"]
    assert_same_fit(est, ref)
    assert read_meta(ck / "anneal.npz")["phase"] == "done"


def test_npz_path_is_the_file(data, tmp_path):
    path = tmp_path / "sub" / "state.npz"
    est = fa.AnnealedKMeans(5, random_state=0, n_steps=4, checkpoint=path).fit(data)
    assert path.is_file() and est.checkpoint_info_["path"] == str(path)
    assert sorted(os.listdir(path.parent)) == ["state.npz"]      # no temporaries left
    assert read_meta(path)["phase"] == "done"


# ============================================================================ reuse / replace
def test_finished_checkpoint_is_reused(data, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    a = fa.AnnealedKMeans(5, random_state=0, n_steps=8, checkpoint=ck).fit(data)
    assert a.checkpoint_info_["finished"] is False and a.checkpoint_info_["resumed_from"] is None
    meta = read_meta(ck / "anneal.npz")
    assert meta["phase"] == "done" and meta["key"]

    def no_annealing(*args, **kwargs):
        raise AssertionError("a finished checkpoint must not be annealed again")
    monkeypatch.setattr(_engine, "_loop", no_annealing)
    monkeypatch.setattr(_engine, "polish_state", no_annealing)
    b = fit_without_bad_file_warning(
        fa.AnnealedKMeans(5, random_state=0, n_steps=8, checkpoint=ck), data)
    monkeypatch.undo()
    assert b.checkpoint_info_["finished"] is True
    assert b.checkpoint_info_["resumed_from"] == meta["step"]
    assert_same_fit(b, a)
    assert b.free_energy_ == a.free_energy_


@pytest.mark.parametrize("change", ["random_state", "data", "n_steps"])
def test_checkpoint_of_another_fit_is_replaced(change, data, tmp_path):
    ck = tmp_path / "ck"
    fa.AnnealedKMeans(5, random_state=0, n_steps=8, checkpoint=ck).fit(data)
    key0 = read_meta(ck / "anneal.npz")["key"]
    kw = dict(random_state=0, n_steps=8)
    X = data
    if change == "random_state":
        kw["random_state"] = 1
    elif change == "n_steps":
        kw["n_steps"] = 7
    else:
        X = data.copy()
        X[17, 3] += 1e-6                  # one value differs
    fresh = fa.AnnealedKMeans(5, **kw).fit(X)
    est = fit_without_bad_file_warning(fa.AnnealedKMeans(5, checkpoint=ck, **kw), X)
    assert est.checkpoint_info_["finished"] is False
    assert est.checkpoint_info_["resumed_from"] is None
    assert est.checkpoint_info_["replaced"] is True
    assert_same_fit(est, fresh)
    meta = read_meta(ck / "anneal.npz")
    assert meta["key"] != key0 and meta["phase"] == "done"
    again = fit_without_bad_file_warning(fa.AnnealedKMeans(5, checkpoint=ck, **kw), X)
    assert again.checkpoint_info_["finished"] is True
    assert again.checkpoint_info_["replaced"] is False


def test_minibatch_finished_checkpoint_is_reused(data, tmp_path):
    ck = tmp_path / "ck"
    kw = dict(random_state=0, n_steps=6, batch_size=250, checkpoint=ck)
    a = fa.MiniBatchAnnealedKMeans(5, **kw).fit(data)
    assert a.checkpoint_info_["finished"] is False
    b = fit_without_bad_file_warning(fa.MiniBatchAnnealedKMeans(5, **kw), data)
    assert b.checkpoint_info_["finished"] is True
    assert_array_equal(b.cluster_centers_, a.cluster_centers_)
    assert_array_equal(b.labels_, a.labels_)
    c = fit_without_bad_file_warning(
        fa.MiniBatchAnnealedKMeans(5, **dict(kw, random_state=3)), data)
    assert c.checkpoint_info_["finished"] is False and c.checkpoint_info_["resumed_from"] is None


# ============================================================================ bad files
def _rewrite(path, resign=True, **changes):
    """Rewrite the checkpoint ``path`` with some arrays (or meta fields) replaced; with
    ``resign``, its checksum made anew (a file whose fields, not its bytes, are bad: what
    the checks behind the checksum see)."""
    from fastanneal._checkpoint import _digest
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    for k, v in changes.pop("meta", {}).items():
        meta[k] = v
    arrays["meta"] = np.array(json.dumps(meta))
    arrays.update(changes)
    if resign:
        arrays["checksum"] = np.array(_digest(str(arrays["meta"]), arrays))
    os.unlink(path)
    np.savez(path, **arrays)
    assert path.exists()


def _nan_centers(path):
    with np.load(path) as z:
        C = z["centers"].copy()
    C[1, 2] = np.nan
    _rewrite(path, centers=C)


def _wrong_shape(path):
    with np.load(path) as z:
        C = z["centers"]
    _rewrite(path, centers=np.concatenate([C, C[:, :1]], axis=1))   # one feature too many


def _too_many_clusters(path):
    with np.load(path) as z:
        C = z["centers"]
    _rewrite(path, centers=np.concatenate([C, C[:1] + 1.0]))


def _other_version(path):
    _rewrite(path, meta={"version": _checkpoint.VERSION + 1})


def _garbage(path):
    path.write_bytes(np.random.default_rng(5).bytes(3000))


def _truncated(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _pickled(path):
    """An object array (needs pickle): must be refused, not unpickled."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["meta"] = np.array([str(arrays["meta"])], dtype=object)
    os.unlink(path)
    np.savez(path, **arrays)


def _nan_temperature(path):
    _rewrite(path, meta={"temperature": float("nan")})


def _zero_temperature(path):
    _rewrite(path, meta={"temperature": 0.0})


def _bad_rng_state(path):
    _rewrite(path, meta={"rng_state": {"bit_generator": "PCG64", "state": "edited"}})


def _no_start_temperature(path):
    _rewrite(path, meta={"extra": {}})


def _bad_trace(path):
    _rewrite(path, meta={"trace": [1, 2]})


def _null_rng_state(path):
    _rewrite(path, meta={"rng_state": None})


def _negative_scale(path):
    _rewrite(path, meta={"scale": -1.0})


def _version_2(path):
    """A file of the version before the annealing rule's state was kept after its phase."""
    _rewrite(path, meta={"version": 2})


def _npy_file(path):
    """A .npy file (np.load returns an array, not an archive: a TypeError before)."""
    with open(path, "wb") as f:
        np.save(f, np.zeros(3))


def _null_schedule_state(path):
    _rewrite(path, meta={"schedule_state": None})


def _huge_step(path):
    _rewrite(path, meta={"step": 10 ** 30})


def _text_n_iter(path):
    _rewrite(path, meta={"n_iter": "x"})


BAD = {"npy_file": _npy_file, "null_schedule_state": _null_schedule_state,
       "huge_step": _huge_step, "text_n_iter": _text_n_iter, "garbage": _garbage, "truncated": _truncated, "nan_centers": _nan_centers,
       "wrong_shape": _wrong_shape, "too_many_clusters": _too_many_clusters,
       "other_version": _other_version, "pickled": _pickled,
       "nan_temperature": _nan_temperature, "zero_temperature": _zero_temperature,
       "bad_rng_state": _bad_rng_state, "no_start_temperature": _no_start_temperature,
       "bad_trace": _bad_trace, "null_rng_state": _null_rng_state,
       "negative_scale": _negative_scale, "version_2": _version_2}


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "mid-run"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_checkpoint_warns_and_starts_over(bad, finished, data, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    path = ck / "anneal.npz"
    make = CASES["geometric"]
    if finished:
        make(ck).fit(data)
    else:
        interrupt_after_step(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            make(ck).fit(data)
        monkeypatch.undo()
    assert read_meta(path)["phase"] == ("done" if finished else "anneal")
    BAD[bad](path)
    fresh = make(None).fit(data)
    with pytest.warns(CheckpointWarning, match=re.escape(str(path))):
        est = make(ck).fit(data)
    assert est.checkpoint_info_["resumed_from"] is None
    assert est.checkpoint_info_["finished"] is False
    assert_same_fit(est, fresh)
    # the file now holds this fit's finished state again
    meta = read_meta(path)
    assert meta["phase"] == "done" and meta["version"] == _checkpoint.VERSION
    with np.load(path, allow_pickle=False) as z:
        assert np.isfinite(z["centers"]).all()


def test_checkpoint_needs_no_pickle(data, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    interrupt_after_step(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        CASES["gradient"](ck).fit(data)       # rule state (Adam moments) included
    monkeypatch.undo()
    with np.load(ck / "anneal.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    assert "centers" in arrays and "meta" in arrays
    for k, v in arrays.items():
        assert v.dtype != object, k
    assert arrays["centers"].dtype == np.float64 and arrays["centers"].shape == (5, 6)
    meta = json.loads(str(arrays["meta"]))
    for field in ("version", "key", "phase", "step", "temperature", "trace", "extra"):
        assert field in meta, field
    assert meta["version"] == _checkpoint.VERSION and meta["phase"] == "anneal"
    assert meta["step"] == STOP_STEP and len(meta["trace"]) == STOP_STEP
    assert meta["temperature"] > 0 and "T0" in meta["extra"]


# ============================================================================ no Dask
def test_minibatch_numpy_starts_no_dask_cluster(tmp_path, monkeypatch):
    distributed = pytest.importorskip("distributed")

    def refuse(*args, **kwargs):
        raise AssertionError("a NumPy mini-batch fit must not start Dask")
    monkeypatch.setattr(distributed.LocalCluster, "__init__", refuse)
    monkeypatch.setattr(distributed.Client, "__init__", refuse)
    import fastanneal.dask as fdask
    monkeypatch.setattr(fdask, "open_batch_stream", refuse)
    monkeypatch.setattr(fdask, "resolve_client", refuse)
    X, y = blobs(2400, 4, 8, seed=21)
    mb = fa.MiniBatchAnnealedKMeans(4, random_state=0, n_steps=6, batch_size=256,
                                    checkpoint=tmp_path / "ck").fit(X)
    with pytest.raises(ValueError):
        distributed.Client.current()
    assert isinstance(mb.labels_, np.ndarray) and mb.labels_.shape == (2400,)
    assert_array_equal(mb.labels_, mb.predict(X))
    assert mb.labels_path_ is None
    assert mb.n_batches_ >= mb.n_steps_ == 6
    assert read_meta(tmp_path / "ck" / "anneal.npz")["phase"] == "done"
    # AnnealedKMeans(batch_size=...) runs the same in-process mini-batch fit
    est = fa.AnnealedKMeans(4, random_state=0, n_steps=6, batch_size=256).fit(X)
    assert_array_equal(est.labels_, est.predict(X))
    from sklearn.metrics import adjusted_rand_score
    assert adjusted_rand_score(mb.labels_, y) > 0.95


def test_cuda_backend_resumes_to_the_same_result(tmp_path, monkeypatch):
    """``checkpoint=`` with ``backend="cuda"`` (the numba-cuda simulator here; tiny data and
    small launches, it is slow): interrupted after step 2 and resumed, the fit equals an
    uninterrupted one."""
    from fastanneal import _config
    require_cuda()
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 5)
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 13, raising=False)
    X = blobs(48, 3, 4, seed=5)[0]

    def make(ck):
        # a numeric start temperature and no re-allocation: no Lanczos on the simulator
        return fa.AnnealedKMeans(3, random_state=0, n_steps=4, max_iter=2, backend="cuda",
                                 temperature_start=5.0, reallocate=False, checkpoint=ck)
    ref = make(None).fit(X)
    ck = tmp_path / "ck"
    with pytest.MonkeyPatch.context() as mp:
        interrupt_after_step(mp, stop=2)
        with pytest.raises(KeyboardInterrupt):
            make(ck).fit(X)
    assert read_meta(ck / "anneal.npz")["step"] == 2
    est = fit_without_bad_file_warning(make(ck), X)
    assert est.checkpoint_info_["resumed_from"] == 2
    assert_same_fit(est, ref)


def test_protocol_schedule_objects_key_checkpoints_by_class_and_settings():
    """A schedule written to the protocol (not a Schedule subclass) keyed checkpoints by its
    default repr, which holds its memory address: a new process never resumed its fit."""
    from fastanneal._checkpoint import params_key

    class Halving:
        n_steps = 8

        def __init__(self, factor=0.5):
            self.factor = factor

        def next_temperature(self, state):
            return None if state.step + 1 >= self.n_steps else state.T * self.factor

    def key(s):
        return params_key("data", fa.AnnealedKMeans(5, schedule=s)._fit_params())
    assert key(Halving()) == key(Halving())             # two objects, one setting
    assert key(Halving(0.5)) != key(Halving(0.7))
    run = Halving()
    k0 = key(run)
    run.T_start, run._calls = 1.0, 3                    # run state: not a setting
    assert key(run) == k0

    class Slotted:
        __slots__ = ("factor",)

        def __init__(self, factor):
            self.factor = factor

        def next_temperature(self, state):
            return None
    assert key(Slotted(0.5)) != key(Slotted(0.9))

    class Table:
        def __init__(self, temps):
            self.temps = temps

        def next_temperature(self, state):
            return None
    a = np.linspace(1.0, 0.01, 2000)
    b = a.copy()
    b[1000] += 1e-9                                     # a repr elides the middle
    assert key(Table(a)) != key(Table(b)) and key(Table(a)) == key(Table(a.copy()))
    # Schedule subclasses keep the key they always had (their repr): old checkpoints resume
    from fastanneal.schedules import GeometricSchedule
    assert fa.AnnealedKMeans(5, schedule=GeometricSchedule(8))._fit_params()["schedule"] \
        == repr(GeometricSchedule(8))


def test_checkpoint_path_and_file_faults_are_named(tmp_path):
    """A checkpoint path that is an existing plain file fails before the annealing, naming
    the parameter (it failed at the first save with NotADirectoryError on a temporary name);
    a damaged file is 'not a fastanneal checkpoint', not numpy's offer to load it
    unsafely."""
    from fastanneal._checkpoint import CheckpointWarning
    X = np.random.default_rng(0).normal(size=(300, 3))
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ValueError, match="checkpoint=.*is an existing file"):
        fa.AnnealedKMeans(3, checkpoint=f, random_state=0).fit(X)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"garbage, not a zip")
    with pytest.warns(CheckpointWarning, match="not a fastanneal checkpoint") as rec:
        fa.AnnealedKMeans(3, checkpoint=bad, random_state=0).fit(X)
    assert not any("unsafely" in str(w.message) for w in rec)


def test_schedule_run_state_and_slots_do_not_break_fits_or_keys():
    """A Schedule subclass keeps its checkpoint key after a fit (its _* run state is not a
    setting); a protocol schedule with __slots__ fits (vars() of it crashed every fit)."""
    from fastanneal.schedules import Schedule

    class Counting(Schedule):
        def __init__(self, n_steps=6):
            self.n_steps = n_steps

        def next_temperature(self, state):
            self._calls = getattr(self, "_calls", 0) + 1
            return None if state.step + 1 >= self.n_steps else state.T * 0.7

    class Slotted:
        __slots__ = ("n_steps",)

        def __init__(self, n_steps=6):
            self.n_steps = n_steps

        def next_temperature(self, state):
            return None if state.step + 1 >= self.n_steps else state.T * 0.7
    X = np.random.default_rng(0).normal(size=(400, 3))
    s = Counting()
    before = fa.AnnealedKMeans(4, schedule=s)._fit_params()["schedule"]
    km = fa.AnnealedKMeans(4, schedule=s, random_state=0, stop_when_hard=False).fit(X)
    assert km.schedule_._calls >= 1 and not hasattr(s, "_calls")   # (a copy ran)
    assert fa.AnnealedKMeans(4, schedule=km.schedule_)._fit_params()["schedule"] == before
    km = fa.AnnealedKMeans(4, schedule=Slotted(), random_state=0).fit(X)
    assert km.n_steps_ >= 1


# ============================================================================ state kept
class _InterruptedStart(fa.schedules.GeometricSchedule):
    """Raises KeyboardInterrupt in its ``stop``-th ``start`` (a run's first step): with
    ``n_init=3`` and ``stop=2`` the first run has finished and saved its file, the second
    has saved nothing."""
    calls = 0
    stop = None

    def start(self, T_start, T_end):
        type(self).calls += 1
        if type(self).calls == type(self).stop:
            raise KeyboardInterrupt("test interruption at the start of run 1")
        super().start(T_start, T_end)


def test_n_init_resumed_after_a_finished_run_equals_the_uninterrupted_fit(tmp_path,
                                                                           monkeypatch):
    """A finished run's file carries the generator's state after its re-allocation moves
    (they draw from it): resuming ``n_init=3`` after run 0 had finished gave other centers
    than the uninterrupted fit (4 of 6 seeds; inertia 3365.86 vs 3357.76 here)."""
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((8, 5)) * 1.0)[rng.integers(0, 8, 800)] + \
        rng.standard_normal((800, 5))
    kw = dict(random_state=0, n_init=3, stop_when_hard=False)
    ref = fa.AnnealedKMeans(8, schedule=_InterruptedStart(20), **kw).fit(X)
    monkeypatch.setattr(_InterruptedStart, "calls", 0)
    monkeypatch.setattr(_InterruptedStart, "stop", 2)
    ck = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        fa.AnnealedKMeans(8, schedule=_InterruptedStart(20), checkpoint=ck, **kw).fit(X)
    monkeypatch.setattr(_InterruptedStart, "stop", None)
    again = fit_without_bad_file_warning(
        fa.AnnealedKMeans(8, schedule=_InterruptedStart(20), checkpoint=ck, **kw), X)
    assert_array_equal(again.cluster_centers_, ref.cluster_centers_)
    assert again.inertia_ == ref.inertia_


@pytest.mark.parametrize("stop_phase", ["polish", "done"])
def test_minibatch_resumed_after_its_annealing_reports_the_same_attributes(
        stop_phase, tmp_path, monkeypatch):
    """The annealing rule's running prior and counts outlive its phase in the file: a
    mini-batch fit resumed in or after its polish reported ``n_batches_`` 0 (was 12),
    ``rows_seen_`` 0, ``n_passes_`` 14 (was 2) and, mass-constrained, another free
    energy (the prior read back uniform)."""
    rng = np.random.default_rng(6)
    X = rng.standard_normal((5, 4))[rng.integers(0, 5, 3000)] + rng.standard_normal((3000, 4))
    kw = dict(random_state=0, batch_size=300, n_steps=6, mass_constrained=True)
    ref = fa.MiniBatchAnnealedKMeans(5, **kw).fit(X)
    ck = tmp_path / "ck"
    if stop_phase == "polish":
        interrupt_after(monkeypatch, lambda st: st.phase == "polish")
        with pytest.raises(KeyboardInterrupt):
            fa.MiniBatchAnnealedKMeans(5, checkpoint=ck, **kw).fit(X)
        monkeypatch.undo()
    else:
        fa.MiniBatchAnnealedKMeans(5, checkpoint=ck, **kw).fit(X)
    again = fit_without_bad_file_warning(fa.MiniBatchAnnealedKMeans(5, checkpoint=ck, **kw), X)
    assert again.checkpoint_info_["phase"] == stop_phase
    assert_array_equal(again.cluster_centers_, ref.cluster_centers_)
    assert ref.n_batches_ > 0 and ref.rows_seen_ > 0
    for name in ("n_batches_", "rows_seen_", "n_passes_", "n_iter_"):
        assert getattr(again, name) == getattr(ref, name), name
    # (a fit that saves states forgets its pruning bounds at each step: its final soft
    # pass rounds its sums in another order, ~1e-15; the uniform prior moved them 4e-5)
    for name in ("free_energy_", "soft_distortion_", "inertia_"):
        assert getattr(again, name) == pytest.approx(getattr(ref, name), rel=1e-12), name
    assert again.hardening_gap_ == pytest.approx(ref.hardening_gap_,
                                                 abs=1e-12 * ref.soft_distortion_)


class _TableSchedule(fa.schedules.Schedule):
    """Temperatures from a NumPy array it builds at ``start``, with a tuple and a dict
    with integer keys beside it: state a checkpoint must give back as it was."""

    def __init__(self, n_steps=6):
        self.n_steps = n_steps

    def start(self, T_start, T_end):
        super().start(T_start, T_end)
        self._temps = T_start * np.geomspace(1.0, 0.05, self.n_steps)
        self._pair = (1, 2.5)
        self._seen = {0: "start"}

    def next_temperature(self, state):
        assert isinstance(self._temps, np.ndarray) and self._temps.dtype == np.float64
        assert isinstance(self._pair, tuple) and 0 in self._seen
        j = state.step + 1
        return None if j >= self._temps.size else float(self._temps[j])


def test_custom_schedule_state_comes_back_with_its_types(data, tmp_path, monkeypatch):
    """Arrays, tuples and dicts with other than string keys were read back as lists and
    string-keyed dicts (``AttributeError: 'list' object has no attribute 'size'``)."""
    kw = dict(random_state=0, stop_when_hard=False, reallocate=False)
    ref = fa.AnnealedKMeans(5, schedule=_TableSchedule(), **kw).fit(data)
    ck = tmp_path / "ck"
    interrupt_after_step(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        fa.AnnealedKMeans(5, schedule=_TableSchedule(), checkpoint=ck, **kw).fit(data)
    monkeypatch.undo()
    again = fit_without_bad_file_warning(
        fa.AnnealedKMeans(5, schedule=_TableSchedule(), checkpoint=ck, **kw), data)
    assert again.checkpoint_info_["resumed_from"] == 3
    assert_same_fit(again, ref)


class _IteratorSchedule(fa.schedules.Schedule):
    def __init__(self):
        self.n_steps = 5

    def start(self, T_start, T_end):
        super().start(T_start, T_end)
        self._it = iter(T_start * 0.5 ** np.arange(1, 5))

    def next_temperature(self, state):
        return float(next(self._it, None) or 0) or None


def test_a_schedule_state_no_file_can_hold_is_named_and_only_stops_checkpoints(data,
                                                                               tmp_path):
    est = fa.AnnealedKMeans(5, schedule=_IteratorSchedule(), random_state=0,
                            stop_when_hard=False).fit(data)
    assert est.n_steps_ == 5
    with pytest.raises(TypeError, match=r"_IteratorSchedule\._it cannot be saved in a "
                                        r"checkpoint"):
        fa.AnnealedKMeans(5, schedule=_IteratorSchedule(), random_state=0,
                          checkpoint=tmp_path / "ck").fit(data)


def test_a_minibatch_file_without_its_seeding_values_is_a_bad_file(data, tmp_path):
    """A mini-batch fit reads T_c and the batch permutation's seed back from the file: a
    file without them (edited by hand) crashed with a KeyError; it is a bad file now."""
    ck = tmp_path / "ck"
    kw = dict(random_state=0, n_steps=6, batch_size=250, checkpoint=ck)
    a = fa.MiniBatchAnnealedKMeans(5, **kw).fit(data)
    meta = read_meta(ck / "anneal.npz")
    extra = {k: v for k, v in meta["extra"].items() if k != "perm_seed"}
    _rewrite(ck / "anneal.npz", meta={"extra": extra})
    with pytest.warns(CheckpointWarning, match="perm_seed"):
        b = fa.MiniBatchAnnealedKMeans(5, **kw).fit(data)
    assert b.checkpoint_info_["finished"] is False
    assert_array_equal(b.cluster_centers_, a.cluster_centers_)


def test_schedule_of_a_reused_finished_fit_holds_the_runs_state(data, tmp_path):
    """A fit that reuses a finished checkpoint (or resumes after its annealing) reported
    the schedule as given, without the state of the run (AdaptiveSchedule's history)."""
    from fastanneal.adaptive import AdaptiveSchedule
    kw = dict(random_state=0, stop_when_hard=False, checkpoint=tmp_path / "ck")
    a = fa.AnnealedKMeans(5, schedule=AdaptiveSchedule(n_steps=6), **kw).fit(data)
    b = fit_without_bad_file_warning(
        fa.AnnealedKMeans(5, schedule=AdaptiveSchedule(n_steps=6), **kw), data)
    assert b.checkpoint_info_["finished"] is True
    ha, hb = a.schedule_.history_, b.schedule_.history_
    assert len(hb) == len(ha) == 6
    assert [h["T"] for h in hb] == pytest.approx([h["T"] for h in ha], rel=1e-12)


def test_an_edited_or_damaged_checkpoint_fails_its_checksum(data, tmp_path):
    """Hand-edited fields of the right kind were taken (a step past n_steps, phase 'done'
    mid-anneal: reported as a finished fit) or crashed deep in the fit (a schedule state of
    the wrong type: TypeError in the schedule; inf log masses: ZeroDivisionError in the
    kernel). Any change to the file's content now fails its checksum: a warning, and the
    fit starts over to the same centers."""
    ck = tmp_path / "ck"
    kw = dict(random_state=0, n_steps=6, checkpoint=ck)
    a = fa.AnnealedKMeans(5, **kw).fit(data)
    meta = read_meta(ck / "anneal.npz")
    edits = [dict(meta={"phase": "done", "step": 40}),
             dict(meta={"schedule_state": {**meta["schedule_state"], "n_steps": "x"}}),
             dict(meta={"temperature": 1.5})]
    with np.load(ck / "anneal.npz") as z:
        C = z["centers"].copy()
    C[0, 0] = np.nextafter(C[0, 0], np.inf)                         # one bit of one center
    edits.append(dict(centers=C))
    for edit in edits:
        fa.AnnealedKMeans(5, **kw).fit(data)                        # a good file again
        _rewrite(ck / "anneal.npz", resign=False, **edit)
        with pytest.warns(CheckpointWarning, match="checksum"):
            b = fa.AnnealedKMeans(5, **kw).fit(data)
        assert b.checkpoint_info_["finished"] is False
        assert_array_equal(b.cluster_centers_, a.cluster_centers_)


def test_partial_fit_says_it_writes_no_checkpoint_and_keeps_its_dtype(data, tmp_path):
    """checkpoint= did nothing under partial_fit, without a word; a float64 batch of
    values ~1e25 into a float32 model made its centers ~1e23 and the next batch a
    ZeroDivisionError in the kernel."""
    X32 = np.asarray(data, dtype=np.float32)
    est = fa.MiniBatchAnnealedKMeans(5, random_state=0, n_steps=5, checkpoint=tmp_path / "c")
    with pytest.warns(CheckpointWarning, match="partial_fit writes no checkpoint"):
        est.partial_fit(X32)
    assert not (tmp_path / "c").exists()
    C = est.cluster_centers_.copy()
    with pytest.raises(ValueError, match="too large for float32"):
        est.partial_fit(X32.astype(np.float64) * 1e25)
    assert_array_equal(est.cluster_centers_, C)                      # unchanged
    est.partial_fit(X32.astype(np.float64))                          # taken as float32
    assert est.cluster_centers_.dtype == np.float32
    est.partial_fit(X32)
    assert np.isfinite(est.cluster_centers_).all()


def test_checkpoint_info_temperature_is_none_for_a_fit_that_did_not_resume(data, tmp_path):
    """The mini-batch route reported its start temperature there on a fresh fit (the
    in-memory route None, as documented: the temperature a fit resumed from)."""
    for est in (fa.AnnealedKMeans(5, random_state=0, n_steps=6, checkpoint=tmp_path / "a"),
                fa.MiniBatchAnnealedKMeans(5, random_state=0, n_steps=6, batch_size=250,
                                           checkpoint=tmp_path / "b")):
        est.fit(data)
        assert est.checkpoint_info_["resumed_from"] is None
        assert est.checkpoint_info_["temperature"] is None
