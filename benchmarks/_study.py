"""Shared pieces of the fidelity studies (``benchmarks/study_*.py`` and the notebooks).

* ``DATASETS``: the sixteen study datasets, by name, each loadable at a full and a ``quick``
  size: the scikit-learn sets (iris, wine, breast_cancer, digits), CLINC150 (all 150 intents
  and six per-domain subsets of 15 intents) and five synthetic families.
* ``load(name, quick)`` -> ``Dataset`` (float64 rows, true labels, K, metric, description).
* ``lloyd_fixed_point``: an exact Lloyd fixed point (scikit-learn k-means++ / Lloyd, then
  float64 Lloyd steps until the labels stop changing), the common starting point of the
  zero-temperature checks.
* ``machine_info``, ``write_json`` (atomic), ``print_table``.

CLINC150 rows are unit vectors (all-MiniLM-L6-v2, normalised); the studies use the squared
Euclidean distance on them, which is ``2 - 2 cos``, so nothing depends on center projection.
wine and breast_cancer are standardised (their raw features differ in scale by 1e3).
"""
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: the full CLINC150 file; FASTANNEAL_CLINC overrides (a missing path simulates its absence)
CLINC = Path(os.environ.get("FASTANNEAL_CLINC",
                            HERE.parents[1] / "shared" / "data" / "clinc150.parquet"))
BUNDLED = HERE.parent / "fastanneal" / "data" / "clinc150_demo.parquet"

#: CLINC150 intents by domain (Larson et al., EMNLP 2019: ten domains of fifteen intents).
CLINC_DOMAINS = {
    "banking": "transfer transactions balance freeze_account pay_bill bill_balance bill_due "
               "interest_rate routing min_payment order_checks pin_change report_fraud "
               "account_blocked spending_history",
    "credit_cards": "credit_score report_lost_card credit_limit rewards_balance new_card "
                    "application_status card_declined international_fees apr redeem_rewards "
                    "credit_limit_change damaged_card replacement_card_duration "
                    "improve_credit_score expiration_date",
    "kitchen_and_dining": "recipe restaurant_reviews calories nutrition_info "
                          "restaurant_suggestion ingredients_list ingredient_substitution "
                          "cook_time food_last meal_suggestion restaurant_reservation "
                          "confirm_reservation how_busy cancel_reservation accept_reservations",
    "home": "shopping_list shopping_list_update next_song play_music update_playlist todo_list "
            "todo_list_update calendar calendar_update what_song order order_status reminder "
            "reminder_update smart_home",
    "auto_and_commute": "traffic directions gas gas_type distance current_location mpg "
                        "oil_change_when oil_change_how jump_start uber schedule_maintenance "
                        "last_maintenance tire_pressure tire_change",
    "travel": "book_flight book_hotel car_rental travel_suggestion travel_alert "
              "travel_notification carry_on timezone vaccines translate flight_status "
              "international_visa lost_luggage plug_type exchange_rate",
    "utility": "time alarm share_location find_phone weather text spelling make_call timer "
               "date calculator measurement_conversion flip_coin roll_dice definition",
    "work": "direct_deposit pto_request taxes payday w2 pto_balance pto_request_status "
            "next_holiday insurance insurance_change schedule_meeting pto_used "
            "meeting_schedule rollover_401k income",
    "small_talk": "greeting goodbye tell_joke where_are_you_from how_old_are_you "
                  "what_is_your_name who_made_you thank_you what_can_i_ask_you "
                  "what_are_your_hobbies do_you_have_pets are_you_a_bot meaning_of_life "
                  "who_do_you_work_for fun_fact",
    "meta": "change_ai_name change_user_name cancel user_name reset_settings whisper_mode "
            "repeat no yes maybe change_language change_accent change_volume change_speed "
            "sync_device",
}
CLINC_DOMAINS = {k: v.split() for k, v in CLINC_DOMAINS.items()}
#: the six domains the studies use as per-domain subsets
STUDY_DOMAINS = ("banking", "credit_cards", "kitchen_and_dining", "travel", "utility",
                 "small_talk")


@dataclass
class Dataset:
    name: str
    X: np.ndarray          # (n, d) float64, C-contiguous
    y: np.ndarray          # (n,) int true labels
    K: int
    metric: str            # "euclidean" or "cosine" (rows are then unit vectors)
    family: str            # "sklearn", "clinc", "synthetic"
    description: str

    @property
    def shape(self):
        return self.X.shape


# ---------------------------------------------------------------- loaders
def _sklearn(name, quick):
    from sklearn import datasets
    loader = {"iris": datasets.load_iris, "wine": datasets.load_wine,
              "breast_cancer": datasets.load_breast_cancer,
              "digits": datasets.load_digits}[name]
    b = loader()
    X = np.asarray(b.data, dtype=np.float64)
    desc = f"scikit-learn {name}"
    if name in ("wine", "breast_cancer"):
        X = (X - X.mean(0)) / X.std(0)
        desc += " (standardised)"
    y = np.asarray(b.target)
    return Dataset(name, np.ascontiguousarray(X), y, int(y.max() + 1), "euclidean", "sklearn",
                   desc)


def clinc_available():
    return CLINC.exists()


def load_clinc_table(path=None):
    """All CLINC150 rows: float32 unit embeddings, string labels."""
    import pyarrow.parquet as pq
    path = Path(path) if path else (CLINC if CLINC.exists() else BUNDLED)
    t = pq.read_table(path, columns=["embedding", "label"])
    X = np.asarray(t.column("embedding").combine_chunks().flatten(), dtype=np.float32)
    return X.reshape(t.num_rows, -1), np.asarray(t.column("label").to_pylist())


def _clinc(domain, quick, per_intent=None):
    X, labels = load_clinc_table()
    if domain is not None:
        keep = np.isin(labels, CLINC_DOMAINS[domain])
        X, labels = X[keep], labels[keep]
    names, y = np.unique(labels, return_inverse=True)
    if per_intent is None:
        per_intent = (20 if domain is None else 50) if quick else None
    if per_intent is not None:       # deterministic subsample: the first rows of each intent
        idx = np.concatenate([np.flatnonzero(y == k)[:per_intent] for k in range(len(names))])
        X, y = X[np.sort(idx)], y[np.sort(idx)]
    X = X.astype(np.float64)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    name = "clinc150" if domain is None else f"clinc150/{domain}"
    return Dataset(name, np.ascontiguousarray(X), y, len(names), "cosine", "clinc",
                   f"CLINC150 {'all intents' if domain is None else domain + ' domain'}, "
                   f"{len(X)} queries, all-MiniLM-L6-v2 unit embeddings")


def _synthetic(kind, quick, seed=2026):
    rng = np.random.default_rng(seed)
    n = 1500 if quick else 6000
    if kind in ("blobs-separated", "blobs-overlapping"):
        K, d = 8, 8
        spread, sd = (6.0, 0.5) if kind == "blobs-separated" else (2.0, 1.0)
        means = rng.standard_normal((K, d)) * spread
        y = rng.integers(0, K, n)
        X = means[y] + sd * rng.standard_normal((n, d))
        desc = (f"8 isotropic Gaussians in 8-D, center spread {spread:g}, sd {sd:g}"
                + (" (heavy overlap)" if kind == "blobs-overlapping" else ""))
    elif kind == "anisotropic":
        K, d = 6, 4
        means = rng.standard_normal((K, d)) * 4.0
        A = rng.standard_normal((K, d, d)) * np.array([2.0, 0.6, 0.3, 0.3])
        y = rng.integers(0, K, n)
        X = means[y] + np.einsum("nij,nj->ni", A[y], rng.standard_normal((n, d)))
        desc = "6 Gaussians in 4-D with random elongated covariances"
    elif kind == "unequal-sizes":
        K, d = 5, 4
        p = np.array([0.55, 0.25, 0.12, 0.05, 0.03])
        y = rng.choice(K, size=n, p=p)
        means = rng.standard_normal((K, d)) * 4.0
        sd = np.array([1.5, 1.0, 0.7, 0.5, 0.3])
        X = means[y] + sd[y, None] * rng.standard_normal((n, d))
        desc = "5 Gaussians in 4-D, sizes 55/25/12/5/3 %, sd 1.5 to 0.3"
    elif kind == "highdim-sparse":
        K, d, s = 6, 200, 5
        means = np.zeros((K, d))
        for k in range(K):      # each cluster differs from the rest in 5 of 200 coordinates
            means[k, rng.choice(d, s, replace=False)] = rng.choice([-1, 1], s) * 3.0
        y = rng.integers(0, K, n)
        X = means[y] + rng.standard_normal((n, d))
        desc = "6 clusters in 200-D, each offset in 5 random coordinates, unit noise"
    else:
        raise KeyError(kind)
    return Dataset(kind, np.ascontiguousarray(X, dtype=np.float64), np.asarray(y), K,
                   "euclidean", "synthetic", desc)


SKLEARN_SETS = ("iris", "wine", "breast_cancer", "digits")
SYNTHETIC_SETS = ("blobs-separated", "blobs-overlapping", "anisotropic", "unequal-sizes",
                  "highdim-sparse")
DATASETS = (SKLEARN_SETS + ("clinc150",) + tuple(f"clinc150/{d}" for d in STUDY_DOMAINS)
            + SYNTHETIC_SETS)
assert len(DATASETS) == 16


def load(name, quick=False):
    """One study dataset by name (see ``DATASETS``)."""
    if name in SKLEARN_SETS:
        return _sklearn(name, quick)
    if name == "clinc150":
        return _clinc(None, quick)
    if name.startswith("clinc150/"):
        return _clinc(name.split("/", 1)[1], quick)
    if name in SYNTHETIC_SETS:
        return _synthetic(name, quick)
    raise KeyError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")


def select(spec, quick=False):
    """Datasets named in a comma list ("all" = the sixteen); CLINC ones are skipped, with a
    message, when the shared data file is absent."""
    names = DATASETS if spec in (None, "all") else tuple(spec.split(","))
    out = []
    for n in names:
        if n.startswith("clinc") and not clinc_available():
            print(f"skipping {n}: {CLINC} not found")
            continue
        out.append(load(n, quick))
    return out


# ---------------------------------------------------------------- references (float64 NumPy)
def sq_distances(X, C):
    """Squared Euclidean distances in float64, clipped at 0 (NumPy reference)."""
    d = (X * X).sum(1)[:, None] - 2.0 * X @ C.T + (C * C).sum(1)[None, :]
    return np.maximum(d, 0.0)


def margins(X, C):
    """Per-row margin Delta_i = d_(2) - d_(1) in float64."""
    d = sq_distances(X, C)
    part = np.partition(d, 1, axis=1)
    return part[:, 1] - part[:, 0]


def lloyd_fixed_point(X, K, seed=0, max_iter=1000):
    """Centers and labels of an exact Lloyd fixed point (float64): scikit-learn k-means++
    and Lloyd, then NumPy Lloyd steps until no label changes. No empty cluster."""
    from sklearn.cluster import KMeans
    km = KMeans(K, n_init=1, random_state=seed, algorithm="lloyd", tol=0.0).fit(X)
    C = np.asarray(km.cluster_centers_, dtype=np.float64)
    labels = None
    for _ in range(max_iter):
        new = sq_distances(X, C).argmin(1)
        cnt = np.bincount(new, minlength=K)
        if (cnt == 0).any():
            raise RuntimeError("empty cluster at a Lloyd step")
        C = np.zeros_like(C)
        np.add.at(C, new, X)
        C /= cnt[:, None]
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
    return C, labels


def partition_sse(X, labels, K=None):
    """k-means objective of a partition (each cluster around its own mean), float64."""
    X = np.asarray(X, dtype=np.float64)
    K = int(labels.max() + 1) if K is None else K
    cnt = np.bincount(labels, minlength=K).astype(float)
    S = np.zeros((K, X.shape[1]))
    np.add.at(S, labels, X)
    nz = cnt > 0
    return float((X * X).sum() - ((S[nz] ** 2).sum(1) / cnt[nz]).sum())


# ---------------------------------------------------------------- reporting
def machine_info():
    import numba
    import sklearn
    import fastanneal
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "numpy": np.__version__,
            "numba": numba.__version__, "scikit-learn": sklearn.__version__,
            "fastanneal": getattr(fastanneal, "__version__", "dev")}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def write_json(path, payload):
    """Write ``payload`` (plus machine info) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload.setdefault("machine", machine_info())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_jsonable))
    os.replace(tmp, path)
    print(f"wrote {path}")
    return path


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o))


def print_table(rows, columns, title=None):
    """Print dict rows as an aligned text table; ``columns`` = [(key, header, fmt), ...]."""
    if title:
        print(f"\n{title}")
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            if v is None:
                line.append("-")
            elif isinstance(v, str):
                line.append(v)
            else:
                try:
                    line.append(format(v, fmt))
                except (TypeError, ValueError):
                    line.append(str(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, c in enumerate(cells):
        print("  ".join(s.rjust(w) if j and i else s.ljust(w)
                        for i, (s, w) in enumerate(zip(c, widths))))
