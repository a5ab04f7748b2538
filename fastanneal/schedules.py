"""Temperature schedules.

A schedule is a small object with one method, ``next_temperature(state) -> float | None``:
given the state of the annealing after a temperature step (a :class:`ScheduleState`), it
returns the next temperature (a finite number > 0), or ``None`` to stop annealing; the
engine raises an error naming the schedule for anything else, and for a schedule still
going ``MAX_STEPS`` temperatures past its ``n_steps``. ``start(T_start, T_end)``, when the object has it,
is called once before the first step. Pass an instance (``GeometricSchedule(20)``), not
the class. Schedules that need feedback (the adaptive schedule)
read entropy and gradient norms from the state; the others ignore them.
"""
import functools
import hashlib
import math
import numbers
import types
from dataclasses import dataclass, field

#: Temperatures one annealing phase may take beyond its schedule's ``n_steps`` (when it
#: has one): a schedule that never returns None is stopped with an error instead of
#: looping for ever.
MAX_STEPS = 100_000


def check_steps(value, name):
    """A whole number of steps >= 1 (``2.0`` is fine, ``2.5``, ``True`` and ``"3"`` are
    not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    return int(value)


def _const_key(c):
    """A text for a code constant that is the same in every process: nested code objects
    by their own key (their repr holds an address), frozensets sorted (their order
    follows the string hash seed)."""
    if isinstance(c, types.CodeType):
        return _code_key(c)
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const_key(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_key(x) for x in c) + ")"
    return repr(c)


def _code_key(code):
    blob = code.co_code + "|".join([_const_key(c) for c in code.co_consts]
                                   + list(code.co_names)).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def callable_key(f):
    """A text that names a callable the same way in every process and differently for
    different callables (best effort): a function by its module, qualified name and a hash
    of its code (nested code included), defaults and closure values; a
    ``functools.partial`` by its function and arguments; a callable object by its repr
    when its class defines one, else by its class and attributes. Schedules that hold a
    callable (``AdaptiveSchedule(reference=...)``) key checkpoints with it."""
    if isinstance(f, functools.partial):
        return (f"partial({callable_key(f.func)}, {_const_key(tuple(f.args))}, "
                f"{sorted((k, _const_key(v)) for k, v in f.keywords.items())})")
    code = getattr(f, "__code__", None)
    if code is None:
        if type(f).__repr__ is not object.__repr__:
            return repr(f)
        attrs = sorted((k, callable_key(v) if callable(v) else _const_key(v))
                       for k, v in getattr(f, "__dict__", {}).items())
        return f"{type(f).__module__}.{type(f).__qualname__}{attrs}"
    name = f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}"
    cells = tuple(c.cell_contents for c in (getattr(f, "__closure__", None) or ()))
    extra = _const_key((getattr(f, "__defaults__", None) or ()) + cells)
    return f"{name}#{_code_key(code)}{hashlib.sha256(extra.encode()).hexdigest()[:8]}"



def schedule_attrs(s):
    """A schedule object's attributes: its ``__dict__`` and its set ``__slots__`` (the
    state a checkpoint saves, and what its key is made of)."""
    out = dict(getattr(s, "__dict__", {}))
    for cls in type(s).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for k in ([slots] if isinstance(slots, str) else slots):
            if k not in out and k not in ("__dict__", "__weakref__") and hasattr(s, k):
                out[k] = getattr(s, k)
    return out


def schedule_key(s):
    """The checkpoint key of a schedule object, the same in every process and for every
    run of the object: a :class:`Schedule` (or any class with its own ``__repr__``) by its
    repr (``Schedule``'s leaves out the ``T_*`` run state); an object written to the
    protocol by its class and settings -- its attributes (``__slots__`` too) except
    ``T_*`` and ``_*`` ones (run state), arrays by a hash of their bytes (a repr elides
    long arrays), callables by :func:`callable_key`."""
    if type(s).__repr__ is not object.__repr__:
        return repr(s)
    attrs = {}
    for k, v in schedule_attrs(s).items():
        if k.startswith(("T_", "_")):
            continue
        if hasattr(v, "__array__") and not isinstance(v, (numbers.Number, str)):
            import numpy as np
            a = np.ascontiguousarray(v)
            attrs[k] = (f"array{a.dtype}{a.shape}:"
                        f"{hashlib.sha256(a.tobytes()).hexdigest()[:16]}")
        elif callable(v):
            attrs[k] = callable_key(v)
        else:
            attrs[k] = _const_key(v)
    return f"{type(s).__module__}.{type(s).__qualname__}{sorted(attrs.items())}"


@dataclass
class ScheduleState:
    """What the engine knows after finishing the temperature ``T`` (step ``step``)."""
    step: int
    T: float
    T_start: float
    T_end: float
    entropy: float = math.nan          #: mean assignment entropy per unit weight (nats)
    grad_norm: float = math.nan        #: separation-gradient norm (gradient solver only)
    n_distinct: int = 0                #: number of distinct (non-coincident) centers
    n_clusters: int = 0
    extra: dict = field(default_factory=dict)


class Schedule:
    """Base class: subclasses implement :meth:`next_temperature`."""
    n_steps = 30

    def start(self, T_start, T_end):
        """Called once before the first step with the start and end temperatures."""
        self.T_start = float(T_start)
        self.T_end = float(T_end)

    def next_temperature(self, state):  # pragma: no cover - interface
        """The temperature of the next step after ``state`` (a :class:`ScheduleState`), or
        None to stop annealing."""
        raise NotImplementedError

    def __repr__(self):
        # settings only: T_* and _* attributes are run state (a schedule object re-used
        # after an interrupted fit must find its checkpoint under the same key)
        args = ", ".join(f"{k}={callable_key(v) if callable(v) else repr(v)}"
                         for k, v in vars(self).items() if not k.startswith(("T_", "_")))
        return f"{type(self).__name__}({args})"


class ConstantSchedule(Schedule):
    """Hold one temperature for ``n_steps`` steps (soft k-means at a fixed T)."""

    def __init__(self, n_steps=1):
        self.n_steps = check_steps(n_steps, "n_steps")

    def start(self, T_start, T_end):
        super().start(T_start, T_start)

    def next_temperature(self, state):
        return self.T_start if state.step + 1 < self.n_steps else None


class _InterpolatedSchedule(Schedule):
    """``n_steps`` temperatures from ``T_start`` to ``T_end`` (subclasses: the formula)."""

    def __init__(self, n_steps=30):
        self.n_steps = check_steps(n_steps, "n_steps")

    def next_temperature(self, state):
        j = state.step + 1
        if j >= self.n_steps:
            return None
        return self._at(j / max(self.n_steps - 1, 1))


class GeometricSchedule(_InterpolatedSchedule):
    """``T_j = T_start * (T_end / T_start) ** (j / (n_steps - 1))``, j = 0..n_steps-1."""

    def _at(self, s):
        return self.T_start * (self.T_end / self.T_start) ** s


class LinearSchedule(_InterpolatedSchedule):
    """``T_j`` linear from ``T_start`` to ``T_end`` over ``n_steps`` steps."""

    def _at(self, s):
        # (T_start + (T_end - T_start) s cancels to 0 at s = 1 when T_end << T_start)
        return self.T_start * (1.0 - s) + self.T_end * s


class CriticalSchedule(Schedule):
    """Deterministic annealing from just above the critical temperature.

    Starts at ``1.02 * T_c`` (``T_c = 2 lambda_max(C)``) with all centers at the mean and
    cools geometrically by ``cooling`` per step; clusters split as each passes its own
    critical temperature (the engine keeps perturbed duplicates). Stops once ``T`` reached
    ``T_end`` and all ``K`` centers are distinct, or after ``max_steps``.
    """

    def __init__(self, cooling=0.85, max_steps=200):
        if isinstance(cooling, bool) or not isinstance(cooling, numbers.Real) \
                or not 0 < cooling < 1:
            raise ValueError(f"cooling must be in (0, 1); got {cooling!r}")
        self.cooling = float(cooling)
        self.max_steps = check_steps(max_steps, "max_steps")
        self.n_steps = self.max_steps

    def next_temperature(self, state):
        if state.step + 1 >= self.max_steps:
            return None
        if state.T <= self.T_end and state.n_distinct >= state.n_clusters:
            return None
        return max(state.T * self.cooling, self.T_end * self.cooling ** 8)


SCHEDULES = {
    "constant": ConstantSchedule,
    "geometric": GeometricSchedule,
    "linear": LinearSchedule,
    "critical": CriticalSchedule,
}


def make_schedule(schedule, n_steps):
    """Resolve a schedule name or object."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, type):
        raise TypeError(f"schedule must be a Schedule object, not a class: pass "
                        f"{schedule.__name__}() instead of {schedule.__name__}")
    if isinstance(schedule, str):
        if schedule == "adaptive":
            from .adaptive import AdaptiveSchedule  # arrives with the gradient route
            return AdaptiveSchedule(n_steps=n_steps)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES) + ['adaptive']} or a "
                             f"Schedule object; got {schedule!r}")
        cls = SCHEDULES[schedule]
        return cls() if cls is CriticalSchedule else cls(n_steps=n_steps)
    if callable(getattr(schedule, "next_temperature", None)):
        return schedule
    raise TypeError(f"schedule must be a name or a Schedule object; got {type(schedule).__name__}")
