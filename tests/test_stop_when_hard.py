"""The schedule stops once it can only repeat Lloyd's update (docs/theory.md section 6.8), or
once it has settled (section 6.9).

A step ends the schedule when its last pass found every row exactly one-hot (``nnz ==
rows``) and the centers at a fixed point; the colder temperatures are left to the polish.
The tests check the criterion itself (one ambiguous row keeps every temperature), that the
result is the full schedule's (bit for bit where the centers did not move), that overlapping
data still run every temperature, and the cases that must never stop early (mass prior,
gradient solver, ``stop_when_hard=False``, ``polish=False``). The one-hot tests switch the
settled end off (``no_settle``); the settled end has its own tests at the end. Data come from
seeds fixed per test.
"""
import warnings

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from fastanneal import AnnealedKMeans, _engine


@pytest.fixture
def no_settle(monkeypatch):
    """Only the one-hot end of section 6.8 (the settled end needs |dJ| <= a negative bound)."""
    monkeypatch.setattr(_engine, "SETTLE_TOL", -1.0)


def separated(seed, K=6, D=8, n_per=80, sep=40.0, dtype=np.float64):
    """K clusters far apart relative to their spread (every margin >> any T of a fit)."""
    rng = np.random.default_rng(seed)
    M = sep * rng.standard_normal((K, D))
    X = np.concatenate([m + rng.standard_normal((n_per, D)) for m in M])
    return X[rng.permutation(len(X))].astype(dtype), M


def fit(X, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AnnealedKMeans(**kw).fit(X)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("resp", ["softmax", "entmax15"])
def test_hard_schedule_stops_and_equals_the_full_schedule(dtype, resp):
    X, M = separated(0, dtype=dtype)
    kw = dict(n_clusters=6, responsibilities=resp, random_state=3)
    on = fit(X, **kw)
    off = fit(X, stop_when_hard=False, **kw)
    assert on.hardened_step_ is not None and on.hardened_step_ < off.n_steps_ - 1
    assert off.hardened_step_ is None and off.n_steps_ == 20 and len(off.trace_) == 21
    assert on.n_steps_ == on.hardened_step_ + 1
    assert on.n_iter_ < off.n_iter_
    # the skipped temperatures were Lloyd passes from a fixed point: the same result
    assert_array_equal(on.labels_, off.labels_)
    scale = float(np.mean((X - X.mean(0)) ** 2))
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(on.cluster_centers_, off.cluster_centers_, rtol=0,
                               atol=tol * np.sqrt(scale) * 10)
    assert on.inertia_ == pytest.approx(off.inertia_, rel=1e-12 if dtype == np.float64
                                        else 1e-6)


def _two_mirrored_clusters():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((100, 3))
    a -= a.mean(0)
    # point-symmetric about 0: means at -20 and +20 on the first axis
    return np.concatenate([a + [-20.0, 0, 0], -a + [20.0, 0, 0], [[0.0, 0.0, 0.0]]])


def test_a_row_that_stays_ambiguous_keeps_every_temperature(no_settle):
    """Two mirrored clusters and a row halfway between them with a negligible weight: the
    centers stay symmetric, its margin stays ~0, it is never one-hot, so every temperature
    runs; without that row the first temperature is already hard."""
    X = _two_mirrored_clusters()
    clean = fit(X[:-1], n_clusters=2, random_state=0)
    assert clean.hardened_step_ == 0 and clean.n_steps_ == 1
    w = np.ones(len(X))
    w[-1] = 1e-9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amb = AnnealedKMeans(2, random_state=0).fit(X, sample_weight=w)
    assert amb.hardened_step_ is None and amb.n_steps_ == 20


def test_the_schedule_stops_at_the_first_one_hot_temperature(no_settle):
    """With full weight the halfway row joins one cluster as the temperature falls (its
    margin becomes ~8). The schedule stops at the first temperature where every margin
    exceeds ``T log 2^53`` (float64 drop threshold), checked against NumPy at the returned
    centers (a fixed point by then); at the temperature before, that row was still soft."""
    X = _two_mirrored_clusters()
    km = fit(X, n_clusters=2, random_state=0)
    h = km.hardened_step_
    assert h is not None and 0 < h < 19
    T = km.trace_.as_dict()["temperature"]
    d = ((X[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)
    d.sort(axis=1)
    margin = (d[:, 1] - d[:, 0]).min()
    thr = np.log(2.0 ** 53)
    assert margin > T[h] * thr
    assert margin < T[h - 1] * thr


def test_overlapping_clusters_run_every_temperature(no_settle):
    """Where rows stay soft (overlapping clusters) the criterion never holds."""
    rng = np.random.default_rng(11)
    M = 2.5 * rng.standard_normal((8, 2))
    X = np.concatenate([m + rng.standard_normal((150, 2)) for m in M])
    km = fit(X, n_clusters=8, random_state=0)
    assert km.hardened_step_ is None and km.n_steps_ == 20
    d = km.trace_.as_dict()
    assert np.all(d["entropy"][d["step"] >= 0] > 0)


@pytest.mark.parametrize("kw", [dict(stop_when_hard=False), dict(mass_constrained=True),
                                dict(solver="gradient", gradient_steps=2),
                                dict(polish=False)])
def test_never_stops_early_where_the_update_is_not_lloyds(kw):
    X, _ = separated(1)
    km = fit(X, n_clusters=6, random_state=0, n_steps=6, **kw)
    assert km.hardened_step_ is None and km.settled_step_ is None and km.n_steps_ == 6


def test_resumed_fit_makes_the_same_decision(tmp_path):
    """The decision reads only the step's moments: a fit that writes checkpoints (bounds
    reset at every step) stops at the same step, and a rerun from its finished file returns
    the same centers."""
    X, _ = separated(2)
    a = fit(X, n_clusters=6, random_state=4)
    b = fit(X, n_clusters=6, random_state=4, checkpoint=tmp_path / "ck")
    c = fit(X, n_clusters=6, random_state=4, checkpoint=tmp_path / "ck")
    assert a.hardened_step_ == b.hardened_step_ == 0
    assert_array_equal(a.cluster_centers_, b.cluster_centers_)
    assert_array_equal(b.cluster_centers_, c.cluster_centers_)


def test_the_mini_batch_route_reports_no_early_end():
    """``batch_size`` delegates to the stochastic rule, which runs every temperature; the
    attribute exists there too (None)."""
    X, _ = separated(1)
    km = fit(X, n_clusters=6, random_state=0, n_steps=6, batch_size=120)
    assert km.hardened_step_ is None and km.settled_step_ is None


# ------------------------------------------------------------------ the settled end (6.9)
def overlapping(seed=11):
    rng = np.random.default_rng(seed)
    M = 2.5 * rng.standard_normal((8, 2))
    return np.concatenate([m + rng.standard_normal((150, 2)) for m in M])


def _criterion(d, s):
    """Section 6.9 at step ``s`` of a trace (all steps >= 0): J moved <= SETTLE_TOL, the
    rows nearly decided, every codevector its own effective cluster."""
    J, T = d["hard_distortion"], d["temperature"]
    return (abs(J[s - 1] - J[s]) <= _engine.SETTLE_TOL * abs(J[s])
            and d["entropy"][s] <= _engine.SETTLE_ENTROPY
            and d["min_center_distance"][s] ** 2 >= _engine.MERGE * T[s])


def test_overlapping_clusters_settle_at_the_first_quiet_step():
    """Rows stay soft, so the one-hot end never comes (the test above); the schedule ends at
    the first step (after the first) whose J moved by <= 3e-5 relative with the rows nearly
    decided -- checked against the trace -- and the polished result is the full schedule's
    to 1e-4 in J with fewer passes."""
    X = overlapping()
    on = fit(X, n_clusters=8, random_state=0)
    off = fit(X, n_clusters=8, random_state=0, stop_when_hard=False)
    s = on.settled_step_
    assert on.hardened_step_ is None and s is not None and 1 <= s < 19
    assert on.n_steps_ == s + 1 and off.n_steps_ == 20
    d = off.trace_.as_dict()
    keep = d["step"] >= 0
    d = {k: np.asarray(v)[keep] for k, v in d.items()}
    # the full schedule's first s steps are the settled run's (same state, same passes)
    d_on = on.trace_.as_dict()
    np.testing.assert_allclose(np.asarray(d_on["hard_distortion"])[:s + 1],
                               d["hard_distortion"][:s + 1], rtol=1e-12)
    assert _criterion(d, s)
    assert not any(_criterion(d, t) for t in range(1, s))
    assert on.n_iter_ < off.n_iter_
    assert on.inertia_ == pytest.approx(off.inertia_, rel=1e-4)


def test_a_schedule_from_above_Tc_runs_through_its_splits():
    """Started above the critical temperature every codevector sits near the mean (rows
    undecided, entropy log K): the schedule must run on through the splits before it may
    settle or harden, and the fit finds the separated clusters."""
    X, M = separated(3, K=4, D=3, sep=12.0)
    probe = fit(X, n_clusters=4, random_state=0, n_steps=2)
    T0 = 3.0 * probe.critical_temperature_
    km = fit(X, n_clusters=4, random_state=0, temperature_start=T0,
             temperature_end_ratio=1e-4, n_steps=30, init="mean")
    H = np.asarray(km.trace_.as_dict()["entropy"])[np.asarray(km.trace_["step"]) >= 0]
    assert H[0] > 0.99 * np.log(4)
    early = km.settled_step_ if km.settled_step_ is not None else km.hardened_step_
    assert early is not None and H[early] <= _engine.SETTLE_ENTROPY
    assert early > int(np.argmax(H < 0.5))                # ran past the splits
    assert len(np.unique(km.predict(M))) == 4              # one cluster per true center


class _Cfg:
    stop_when_hard = True


class _Rule:
    stops_when_hard = True


class _Ctx:
    cfg = _Cfg()


class _Res:
    relocated = 0


class _St:
    log_masses = None

    def __init__(self, J, T):
        self.last = {"hard_distortion": J, "temperature": T}


@pytest.mark.parametrize("J_prev, entropy, dmin, want", [
    (1000.0 + 0.02, 0.03, 1.0, True),     # quiet step, decided rows, resolved codevectors
    (1000.0 + 0.05, 0.03, 1.0, False),    # J moved by 5e-5 > 3e-5
    (1000.0 - 0.02, 0.03, 1.0, True),     # |dJ| (J may rise at a finite T)
    (1000.0 + 0.02, 0.08, 1.0, False),    # rows undecided (entropy > 0.05 nats)
    (1000.0 + 0.02, 0.03, 0.1, False),    # two codevectors closer than sqrt(MERGE T)
    (None, 0.03, 1.0, False),             # the first step of a schedule
])
def test_the_settled_criterion_reads_each_condition(J_prev, entropy, dmin, want):
    """Section 6.9 condition by condition, at T = 0.1 (sqrt(MERGE T) = 0.22)."""
    st = _St(1000.0, 0.1)
    assert _engine.settled(_Ctx(), st, _Rule(), _Res(), 0, J_prev, entropy, dmin) is want
    if want:      # and never with a relocation, coincident centers or a mass prior
        res = _Res()
        res.relocated = 1
        assert not _engine.settled(_Ctx(), st, _Rule(), res, 0, J_prev, entropy, dmin)
        assert not _engine.settled(_Ctx(), st, _Rule(), _Res(), 1, J_prev, entropy, dmin)
        st.log_masses = np.zeros(2)
        assert not _engine.settled(_Ctx(), st, _Rule(), _Res(), 0, J_prev, entropy, dmin)


def test_a_resumed_fit_settles_at_the_same_step(tmp_path):
    """The decision reads the step's moments and the previous step's J, which the state
    carries: a fit that writes checkpoints settles at the same step, and a rerun from its
    finished file returns the same centers."""
    X = overlapping(12)
    a = fit(X, n_clusters=8, random_state=2)
    b = fit(X, n_clusters=8, random_state=2, checkpoint=tmp_path / "ck")
    c = fit(X, n_clusters=8, random_state=2, checkpoint=tmp_path / "ck")
    assert a.settled_step_ is not None and a.settled_step_ == b.settled_step_
    assert_array_equal(b.cluster_centers_, c.cluster_centers_)


@pytest.mark.parametrize("data_seed, seed", [(116, 0), (117, 1)])
def test_a_quiet_step_before_a_late_transition_does_not_end_the_schedule(data_seed, seed):
    """Two fits whose annealing path has a plateau (a step moving J by < 3e-5) at a mean
    entropy of 0.08-0.09 nats, then a late transition: with the first entropy bound (0.1)
    the schedule ended on the plateau and the fit lost 3.0 % and 4.5 % of J to the full
    schedule (BENCHMARKS 17). Under ``SETTLE_ENTROPY`` the rows are not yet decided there:
    the fit runs on and ends where the full schedule ends."""
    assert _engine.SETTLE_ENTROPY <= 0.05
    X = overlapping(data_seed)
    on = fit(X, n_clusters=8, random_state=seed)
    off = fit(X, n_clusters=8, random_state=seed, stop_when_hard=False)
    assert on.inertia_ == pytest.approx(off.inertia_, rel=1e-6)


class _Reheat:
    """Cools from T_start to 0.05 T_start in ``half`` steps, jumps to 20 T_start, cools
    again (a re-heating schedule: only the plain ``next_temperature`` protocol)."""

    def __init__(self, half=6):
        self.half = half
        self.T_start = None

    def start(self, T_start, T_end):
        self.T_start = T_start

    def next_temperature(self, state):
        j = state.step + 1
        if j >= 2 * self.half:
            return None
        f = (j % self.half) / (self.half - 1)
        return self.T_start * 0.05 ** f if j % self.half else 20.0 * self.T_start


def test_a_schedule_that_goes_hotter_next_is_not_ended_early():
    """The early ends hold because each COLDER temperature would change nothing: this fit
    settled at the last step before the re-heat and ended there (6 of 12 temperatures, J
    6023.9 against the full schedule's 6049.6, other centers)."""
    rng = np.random.default_rng(7)
    X = (2.5 * rng.standard_normal((6, 4)))[rng.integers(0, 6, 1500)] + \
        rng.standard_normal((1500, 4))
    kw = dict(n_clusters=6, random_state=1, reallocate=False)
    on = fit(X, schedule=_Reheat(), **kw)
    off = fit(X, schedule=_Reheat(), stop_when_hard=False, **kw)
    T = np.asarray(on.trace_["temperature"])
    assert on.n_steps_ == off.n_steps_ == 12
    assert T[6] > T[5]                              # the re-heat ran
    assert_array_equal(on.cluster_centers_, off.cluster_centers_)


def test_a_schedule_whose_iterator_runs_out_says_so():
    class Gen:
        def start(self, T_start, T_end):
            self._it = iter([T_start / 2, T_start / 4])

        def next_temperature(self, state):
            return next(self._it)

    X, _ = separated(0)
    with pytest.raises(ValueError, match="Gen.next_temperature raised StopIteration after "
                                         "step 2; a schedule ends by returning None"):
        fit(X, n_clusters=6, schedule=Gen(), random_state=0, stop_when_hard=False)


def test_linear_schedule_and_partial_fit_end_at_a_tiny_end_ratio():
    """``T_start + (T_end - T_start) s`` cancelled to 0 at ``s = 1`` for ratios below
    1.1e-16 (an error after step 18; partial_fit divided by zero)."""
    X, _ = separated(0)
    est = fit(X, n_clusters=6, schedule="linear", temperature_end_ratio=1e-17,
              stop_when_hard=False, random_state=0)
    T = np.asarray(est.trace_["temperature"])
    assert T[-2] == pytest.approx(1e-17 * est.temperature_start_, rel=1e-12)
    p = AnnealedKMeans(6, schedule="linear", temperature_end_ratio=1e-17, n_steps=3,
                       random_state=0)
    for i in range(4):
        p.partial_fit(X[120 * i:120 * (i + 1)])
    assert p.temperature_ == pytest.approx(1e-17 * p._partial_state.T_start, rel=1e-12)


def test_an_end_temperature_below_the_smallest_normal_is_named():
    X, _ = separated(0)
    for est in (AnnealedKMeans(6, temperature_end_ratio=1e-300, random_state=0),
                AnnealedKMeans(6, temperature_end_ratio=1e-300, random_state=0,
                               batch_size=100)):
        with pytest.raises(ValueError, match=r"temperature_end_ratio=1e-300 times the start "
                                             r"temperature .* below the smallest normal"):
            est.fit(X * 1e-5)
