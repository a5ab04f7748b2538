"""The annealing trace: one record per temperature step (and per iteration with
``diagnostics="full"``), convertible to a dict of NumPy arrays or a pyarrow Table."""
import numpy as np

#: Columns of a trace, in order, with their meaning.
COLUMNS = {
    "step": "temperature step (0-based); -1 for the polish phase at T = 0",
    "iteration": "cumulative number of moment passes",
    "temperature": "T of this record",
    "entropy": "assignment entropy per unit weight (nats; Tsallis-1.5 for entmax15)",
    "free_energy": "soft objective F_T of the centers this record's pass started from",
    "hard_distortion": "hard objective J of the same centers",
    "soft_distortion": "expected distortion of the randomized (soft) rule, sum w r d",
    "hardening_gap": "soft distortion - J of the same centers (>= 0): what hardening gains",
    "certificate_gap": "J - F_T (>= 0 for plain responsibilities, <= 0 mass-constrained)",
    "certificate_bound": "T W log K, the upper bound on J - F_T (entmax15: (4/3) T W "
                         "(1 - K^-1/2)); mass-constrained softmax: the lower bound "
                         "T sum_k J-weight_k log p_k (then J - F_T <= 0)",
    "certificate_ok": "J - F_T within its bounds (up to rounding)",
    "min_center_distance": "min over k != l of ||c_k - c_l|| after the step",
    "center_shift": "max_k ||c_k(new) - c_k(old)||^2 of the last update",
    "relocations": "empty clusters relocated in this step",
    "coincident": "centers coincident with another one (mass-constrained duplicates)",
    "n_distinct": "number of distinct centers after the step",
    "margin_sum": "sum_i w_i exp(-Delta_i / T): how far soft is from hard",
    "grad_norm": "separation-gradient norm (gradient solver; NaN otherwise)",
    "wall_time": "seconds since the start of fit",
}


class Trace:
    """Append-only list of records with conversions; ``len(trace)`` is the number of records."""

    def __init__(self):
        self._rows = []

    def append(self, **row):
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown trace columns {sorted(unknown)}")
        self._rows.append(row)

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.as_dict()[key]
        return self._rows[key]

    def as_dict(self):
        """Dict of 1-D NumPy arrays, one per column (pandas-free)."""
        out = {}
        for c in COLUMNS:
            vals = [r.get(c, np.nan) for r in self._rows]
            if c in ("step", "iteration", "relocations", "coincident", "n_distinct"):
                out[c] = np.asarray([(-1 if v is None or v != v else v) for v in vals],
                                    dtype=np.int64)
            elif c == "certificate_ok":
                out[c] = np.asarray([bool(v) if v == v else False for v in vals], dtype=bool)
            else:
                out[c] = np.asarray(vals, dtype=np.float64)
        return out

    def to_arrow(self):
        """The trace as a ``pyarrow.Table``."""
        import pyarrow as pa
        return pa.table(self.as_dict())

    def __repr__(self):
        return f"Trace({len(self)} records)"
