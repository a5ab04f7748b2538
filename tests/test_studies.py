"""The building blocks of the fidelity studies (benchmarks/) against brute-force references,
so that a wrong study helper fails here and not only as an odd figure in a notebook."""
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _study  # noqa: E402


def test_clinc_domains_partition_the_intents():
    intents = [i for v in _study.CLINC_DOMAINS.values() for i in v]
    assert len(_study.CLINC_DOMAINS) == 10
    assert all(len(v) == 15 for v in _study.CLINC_DOMAINS.values())
    assert len(set(intents)) == 150
    _, labels = _study.load_clinc_table()        # shared file, else the bundled sample
    assert set(np.unique(labels)) <= set(intents)
    if _study.clinc_available():
        assert set(np.unique(labels)) == set(intents)


@pytest.mark.parametrize("name", ["iris", "blobs-separated", "highdim-sparse"])
def test_lloyd_fixed_point_is_a_fixed_point(name):
    ds = _study.load(name, quick=True)
    C, labels = _study.lloyd_fixed_point(ds.X, ds.K, seed=1)
    d = ((ds.X[:, None, :] - C[None]) ** 2).sum(-1)           # direct, not the GEMM form
    np.testing.assert_array_equal(d.argmin(1), labels)
    for k in range(ds.K):
        np.testing.assert_allclose(C[k], ds.X[labels == k].mean(0), rtol=1e-12, atol=1e-12)
    m = _study.margins(ds.X, C)
    s = np.sort(d, axis=1)
    np.testing.assert_allclose(m, s[:, 1] - s[:, 0], rtol=1e-9, atol=1e-9)


def test_partition_sse_matches_direct_sum(rng):
    X = rng.standard_normal((300, 5))
    lab = rng.integers(0, 7, 300)
    direct = sum(((X[lab == k] - X[lab == k].mean(0)) ** 2).sum() for k in np.unique(lab))
    assert _study.partition_sse(X, lab) == pytest.approx(direct, rel=1e-10)


def test_k_occurrence_matches_brute_force(rng):
    hub = pytest.importorskip("study_hubness")
    X = rng.standard_normal((250, 12))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    occ = hub.k_occurrence(X, ks=(3, 7))
    S = X @ X.T
    np.fill_diagonal(S, -np.inf)
    for k in (3, 7):
        nn = np.argsort(-S, axis=1, kind="stable")[:, :k]
        ref = np.bincount(nn.ravel(), minlength=len(X))
        np.testing.assert_array_equal(occ[k], ref)
        assert occ[k].sum() == k * len(X)
    assert hub.skewness(np.r_[np.zeros(99), 100.0]) > 5


def test_hartigan_ends_in_a_single_move_optimum(rng):
    hs = pytest.importorskip("study_hardening")
    X = np.concatenate([rng.standard_normal((80, 3)) + c for c in ([0, 0, 0], [3, 0, 0],
                                                                    [0, 3, 0])])
    start = rng.integers(0, 3, len(X))
    lab, moves, _ = hs.hartigan(X, start, 3)
    sse = _study.partition_sse(X, lab, 3)
    assert sse <= _study.partition_sse(X, start, 3) + 1e-9 and moves > 0
    # brute force: no single point move lowers the objective
    for i in range(len(X)):
        for b in range(3):
            if b == lab[i] or (lab == lab[i]).sum() == 1:
                continue
            trial = lab.copy()
            trial[i] = b
            assert _study.partition_sse(X, trial, 3) >= sse - 1e-9


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_settle_study_objective_matches_direct_sum(rng, metric):
    """``study_settle.objective``: SSE about the cluster means (Euclidean) or the spherical
    objective ``sum (2 - 2 cos(x, unit mean))`` (cosine), against direct sums."""
    import study_settle

    class Fit:
        labels_ = rng.integers(0, 4, 200)
    X = rng.standard_normal((200, 6)) + 2.0
    got = study_settle.objective(X, Fit, metric)
    lab = Fit.labels_
    if metric == "cosine":
        U = X / np.linalg.norm(X, axis=1, keepdims=True)
        want = 0.0
        for k in range(4):
            c = U[lab == k].mean(0)
            c /= np.linalg.norm(c)
            want += (2.0 - 2.0 * U[lab == k] @ c).sum()
    else:
        want = sum(((X[lab == k] - X[lab == k].mean(0)) ** 2).sum() for k in range(4))
    assert got == pytest.approx(want, rel=1e-10)


def test_settle_study_table_renders_from_its_json():
    """``render_md.r_settle`` turns the study's summary into the BENCHMARKS 17 table."""
    import render_md
    row = {"dataset": "a20", "seeds": 2, "obj_rel_median": 1.0, "obj_rel_max": 1.00002,
           "worse_1e4": 0, "better_1e4": 1, "ci0_off": 2, "ci0_on": 2, "settled": 1,
           "settled_step": 3.0, "passes_off": 30.0, "passes_on": 14.5, "time_ratio": 0.7}
    md = render_md.r_settle({"summary": [row, dict(row, dataset="overlap-2d", ari_off=0.5,
                                                   ari_on=0.49, settled=0,
                                                   settled_step=None)]})
    lines = md.splitlines()
    assert lines[0].startswith("| data | objective on/off")
    assert lines[2] == ("| a20 | 1.000000 / 1.000020 | 0 / 1 | CI = 0: 2 → 2 | 1/2 (step 3) "
                        "| 30.0 → 14.5 | 0.70 |")
    assert "ARI 0.5000 → 0.4900" in lines[3] and "| 0/2 |" in lines[3]


def test_gpu_table_renders_the_committed_gpu_check_json():
    """``render_md.r_gpu`` renders BENCHMARKS §8's generated block from the committed
    ``gpu_check.json`` (an H200 run): every timed pass with its products path, and the
    K = 20,000 line; the block in BENCHMARKS.md is that rendering."""
    import render_md
    d = render_md.load("gpu_check")
    md = render_md.r_gpu(d)
    rows = [ln for ln in md.splitlines() if ln.startswith("| 256 |") or
            ln.startswith("| 1024 |")]
    assert len(rows) == sum(len(t["modes"]) for t in d["timing"]) == 6
    assert all("| cublas |" in r for r in rows)
    assert "25 annealing passes in" in md and "correctness: PASS" in md
    bench = (Path(render_md.__file__).resolve().parents[1] / "BENCHMARKS.md").read_text()
    block = bench.split("<!-- BEGIN gpu_check -->\n")[1].split("\n<!-- END gpu_check -->")[0]
    assert block == md


def test_variant_study_parses_variants_and_restores_the_engine():
    """``study_variants``: upper-case names are engine constants (restored after the fit),
    others estimator parameters; the variant really reaches the fit."""
    import study_variants as sv
    from fastanneal import _engine
    consts, params = sv.parse_variant("SETTLE_TOL=0.0001, max_iter=2,polish=False")
    assert consts == {"SETTLE_TOL": 0.0001} and params == {"max_iter": 2, "polish": False}
    with pytest.raises(SystemExit):
        sv.parse_variant("NO_SUCH_CONSTANT=1")
    X = np.random.default_rng(0).normal(size=(200, 2))
    before = _engine.SETTLE_TOL
    m1, _ = sv.fit(X, 3, 0, "euclidean", {"SETTLE_TOL": -1.0}, {"max_iter": 1})
    assert _engine.SETTLE_TOL == before
    m2, _ = sv.fit(X, 3, 0, "euclidean", {}, {})
    assert m1.n_iter_ != m2.n_iter_
