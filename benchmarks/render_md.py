"""Render the tables of ``BENCHMARKS.md`` from ``benchmarks/results/*.json``.

    python benchmarks/render_md.py            # rewrite the tables in BENCHMARKS.md in place
    python benchmarks/render_md.py --print    # print them instead

Every table in BENCHMARKS.md sits between ``<!-- BEGIN name -->`` and ``<!-- END name -->``
markers and is regenerated from the JSON the benchmark wrote, so no figure is typed by hand.
The verdicts around the tables are prose, written against these numbers.
"""
import argparse
import json
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "BENCHMARKS.md"


def table(rows, cols):
    """Markdown table; cols = [(key or callable, header, fmt)]."""
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = key(r) if callable(key) else r.get(key)
            if v is None:
                cells.append("–")
            elif isinstance(v, str):
                cells.append(v.replace("|", "\\|"))
            elif isinstance(v, bool):
                cells.append("yes" if v else "**no**")
            else:
                cells.append(format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load(name):
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def machine_line(m, date=None):
    if not m:
        return ""
    parts = [f"{m.get('cpus')} CPUs"]
    if m.get("cpu_model"):
        parts.append(m["cpu_model"])
    for k in ("python", "numpy", "numba", "scikit-learn"):
        if m.get(k):
            parts.append(f"{k} {m[k]}")
    d = date or m.get("date")
    return f"\n\n_Run {d}; {', '.join(parts)}._" if d else f"\n\n_{', '.join(parts)}._"


# ----------------------------------------------------------------------------- renderers
def r_kernels(d):
    by = {}
    for r in d["rows"]:
        by.setdefault(r["case"], {})[r["K"]] = r["ratio_to_gemm"]
    ks = d["ks"]
    rows = [{"case": c, **{f"K{k}": v.get(k) for k in ks}} for c, v in by.items()
            if any(x == x for x in v.values())]          # drop all-NaN (non-timing) rows
    out = table(rows, [("case", "pass (N=%d, D=%d, float32)" % (d["n"], d["d"]), "")]
                + [(f"K{k}", f"K={k} ×GEMM", ".2f") for k in ks])
    c, m = d["compile"], d.get("memory")
    out += (f"\n\nCold compile of all kernels (one dtype): {c['cold_first_calls_s']:.1f} s; warm "
            f"import + first call: {c['warm_import_plus_first_call_s']:.2f} s.")
    if m:
        out += (f" Peak extra memory of one pass at N={m['n']:,}, K={m['k']}: "
                f"{m['extra_mb']:.0f} MB = {100 * m['extra_fraction_of_X']:.1f} % of X.")
    else:
        out += " (Memory not measured in this run: `--memory` measures it.)"
    return out + machine_line(d["machine"], d.get("date"))


def r_quality(d):
    return table(d["summary"], [
        ("dataset", "dataset", ""), ("method", "method", ""), ("runs", "seeds", "d"),
        ("ari", "ARI", ".3f"), ("ari_min", "ARI min", ".3f"), ("nmi", "NMI", ".3f"),
        ("sse_vs_ref", "SSE / sklearn n_init=10", ".4f"),
        (lambda r: format(r["obj_vs_ref"], ".5f") if "obj_vs_ref" in r else "–",
         "objective / n_init=10", ""),
        ("time_vs_ref", "time / sklearn n_init=10", ".2f")]) + \
        f"\n\n_Run {d.get('date')}; {d.get('cpus')} CPUs._"


def r_dask(d):
    fb = d["full_batch"]
    rows = [{"path": k, "s": fb["seconds"][k], "r": fb["ratio_to_in_memory"][k],
             "g": fb["ratio_to_gemm"][k]} for k in fb["seconds"]]
    out = (f"One moments pass, N={fb['n']:,}, D={fb['d']}, K={fb['k']}, chunks of "
           f"{fb['chunk_rows']:,} rows, median of {fb['repeats']}:\n\n")
    out += table(rows, [("path", "path", ""), ("s", "seconds", ".2f"),
                        ("r", "× in-memory", ".2f"), ("g", "× GEMM", ".2f")])
    mb = d["minibatch"]
    rows = [{"rows": s["rows"], "gb": s["dataset_bytes"] / 2 ** 30, "rps": s["rows_per_s"],
             "peak": s["peak_rss_bytes"] / 2 ** 20, "frac": s["peak_fraction_of_dataset"],
             "lab": s["labels_written"]} for s in mb["sizes"]]
    out += "\n\nMini-batch annealing out of core (Parquet, D=%d, K=%d):\n\n" % (mb["d"], mb["k"])
    out += table(rows, [("rows", "rows", ","), ("gb", "data GiB", ".2f"),
                        ("rps", "rows/s", ",.0f"), ("peak", "peak RSS MiB", ".0f"),
                        ("frac", "peak / data", ".3f"), ("lab", "labels written", ",")])
    q = mb["quality_vs_full_batch"]["mean"]
    out += (f"\n\nMini-batch vs full batch ({mb['quality_vs_full_batch']['rows']:,} rows, "
            f"{mb['quality_vs_full_batch']['seeds']} seeds): J ratio {q['J_ratio']:.4f}, time "
            f"{q['minibatch_s']:.1f} s vs {q['full_batch_s']:.1f} s.")
    return out + f"\n\n_Command: `{d.get('command')}`; {d['machine'].get('cpus')} CPUs._"


def r_gpu(d):
    rows = []
    for t in d.get("timing", []):
        for mode, v in t.get("modes", {}).items():
            rows.append({"K": t["K"], "mode": mode, "p": t["products"].split()[0],
                         "s": v["seconds"], "r": v["ratio_to_gemm"], "g": t["gemm_seconds"]})
    out = table(rows, [("K", "K", "d"), ("mode", "pass (N=1e6, D=384)", ""),
                       ("p", "products", ""), ("s", "seconds", ".3f"),
                       ("g", "cuBLAS GEMM s", ".4f"), ("r", "× GEMM", ".1f")])
    meta = d["meta"]
    out += (f"\n\n_Device: {meta.get('device')}; numba {meta.get('numba')}; correctness: "
            f"{d['status']}; `{' '.join(['gpu_check.py'] + meta.get('argv', []))}`._")
    big = d.get("k20000")
    if big and "seconds" in big:
        lloyd = big.get("cupy_lloyd", {})
        out += (f"\n\n_1M × 256, K = 20,000: 25 annealing passes in {big['seconds']:.1f} s"
                + (f"; plain CuPy Lloyd 25 iterations {lloyd['seconds']:.1f} s"
                   if "seconds" in lloyd else "") + "._")
    return out


def r_hubness(d):
    out = table(d["k_occurrence"], [
        ("k", "k", "d"), ("skew_clinc", "skewness of N_k", ".2f"),
        ("skew_null", "Gaussian null", ".2f"), ("max_clinc", "max N_k", "d"),
        ("max_null", "null max", "d"), ("antihub_frac", "anti-hubs (N_k = 0)", ".3f"),
        ("antihub_frac_null", "null anti-hubs", ".3f")])
    s = d["schedule"]
    pick = [0, 3, 6, 9, 12, 15, len(s["T_over_Tc"]) - 1]
    rows = [{"t": s["T_over_Tc"][j], **{g: s["entropy"][g][j] for g in s["entropy"]}}
            for j in pick if j < len(s["T_over_Tc"])]
    out += ("\n\nMean responsibility entropy (nats) by group along the schedule "
            "(`T_c = 2 λ_max(C)`):\n\n")
    out += table(rows, [("t", "T / T_c", ".3g"), ("hubs", "hubs (top 1 % N_10)", ".3f"),
                        ("anti-hubs", "anti-hubs", ".3f"), ("rest", "rest", ".3f")])
    res = s["resolution_T_over_Tc_median"]
    rows = [{"g": g, "rows": v["rows"], "t": res[g], "pur": v["purity"]}
            for g, v in d["final_fit"].items()]
    out += "\n\n" + table(rows, [("g", "group", ""), ("rows", "rows", "d"),
                                 ("t", "median resolution T / T_c", ".3f"),
                                 ("pur", "cluster purity (default fit)", ".3f")])
    out += (f"\n\nSpearman(N_10, distance to the mean) = "
            f"{d['spearman_N10_vs_dist_to_mean']:.3f}; n = {d['n']:,}, D = {d['d']}, K = {d['K']}.")
    return out + machine_line(d["machine"])


def r_peers(d):
    out = ""
    for ds, sh in d["shapes"].items():
        out += f"\n\n**{ds}** (n = {sh['n']:,}, D = {sh['d']}, K = {sh['K']}; one GEMM "
        out += f"`X @ C.T` = {1e3 * d['gemm_seconds'][ds]:.1f} ms):\n\n"
        rows = [r for r in d["summary"] if r["dataset"] == ds]
        out += table(rows, [("method", "method", ""), ("runs", "seeds", "d"),
                            ("seconds", "fit s (median)", ".2f"),
                            (lambda r: (f"{r['seconds_min']:.2f}–{r['seconds_max']:.2f}"
                                        if "seconds_min" in r else None), "range", ""),
                            ("time_vs_sklearn1", "× sklearn n_init=1", ".2f"),
                            ("time_vs_gemm", "× GEMM", ".0f"),
                            ("sse_vs_best", "SSE / best", ".4f"), ("ari", "ARI", ".3f"),
                            ("ari_min", "ARI min", ".3f")])
        notes = [f"{r['method']}: {'; '.join(r['notes'])}" for r in rows if r.get("notes")]
        if notes:
            out += "\n\nLogged by the peers during the timed fits: " + " / ".join(notes) + "."
    miss = [k for k, v in d["peers_available"].items() if not v]
    if miss:
        out += "\n\nNot installed, so no figure: " + ", ".join(miss) + "."
    return out.strip() + machine_line(d["machine"])


def r_hardening(d):
    out = ("**Hardening gap vs `temperature_end_ratio`** (`polish=False`, mean over "
           f"{len(d['seeds']) if isinstance(d['seeds'], list) else d['seeds']} seeds; gaps relative to J; `s_med` = median squared center "
           "separation):\n\n")
    out += table(d["gap"]["summary"], [
        ("dataset", "problem", ""), ("ratio", "end ratio", "g"),
        ("T_end_over_smed", "T_end / s_med", ".2g"), ("rel_gap_D", "(D_T − J) / J", ".1e"),
        ("rel_gap_F", "(F_T − J) / J", ".1e"), ("polish_gain", "(J − SSE polished) / SSE", ".1e"),
        ("ari_hard", "ARI hard", ".3f"), ("ari_polished", "ARI polished", ".3f")])
    t = d["trace"]["summary"]
    out += (f"\n\n**One traced schedule** ({t['dataset']}, seed {t['seed']}, {t['records']} "
            f"records): F ≤ J ≤ D at every record: {'yes' if t['order_ok_all'] else 'NO'}; "
            f"of {t['F_improves']} same-temperature iterations where F_T improved, J went down "
            f"in {t['J_down_when_F_improves']}, stayed flat in {t['J_flat_when_F_improves']}, "
            f"rose in {t['J_up_when_F_improves']}. After the first temperature step D_T moved "
            f"{abs(t['rel_change_D_after_step0']):.1e} (relative), J "
            f"{abs(t['rel_change_J_after_step0']):.1e}.")
    out += ("\n\n**Purification** (constant-T soft Lloyd from the reference centers; "
            "randomized rule = sample labels from r):\n\n")
    out += table(d["purification"]["rows"], [
        ("dataset", "problem", ""), ("factor", "T / s_med", "g"), ("T_over_Tc", "T / T_c", ".2f"),
        ("n_distinct_centers", "distinct centers", "d"),
        ("D_randomized", "D_T (randomized)", ".6g"), ("J_argmax", "J (argmax)", ".6g"),
        ("sse_sampled_mean", "SSE sampled partition", ".6g"),
        ("sse_argmax_partition", "SSE argmax partition", ".6g"),
        ("ari_sampled", "ARI sampled", ".3f"), ("ari_argmax", "ARI argmax", ".3f")])
    out += "\n\n**Soft + polish vs hard local search** (mean over seeds; best = lowest SSE seen):\n\n"
    out += table(d["search"]["summary"], [
        ("dataset", "problem", ""), ("method", "method", ""), ("sse_ratio_best", "SSE / best", ".4f"),
        ("sse_ratio_worst", "worst seed", ".4f"), ("ari", "ARI", ".3f"),
        ("moves", "Hartigan moves", ".0f"), ("seconds", "s", ".3f")])
    return out + machine_line(d["machine"])


def r_regimes(d):
    return table(d["summary"], [
        ("dataset", "dataset", ""), ("method", "solver / schedule", ""), ("runs", "seeds", "d"),
        ("ari", "ARI", ".3f"), ("J", "J / scale", ".4f"), ("H_end", "final entropy", ".3g"),
        ("dmu_min", "min center sep.", ".3g"), ("var_g", "var of grad norm", ".3g"),
        ("cv_g", "CV of grad norm", ".3g"), ("t_star", "t*", ".3g"),
        ("seconds", "s", ".1f")]) + f"\n\n_Command: `{d.get('command')}`; run {d.get('date')}._"


def r_theory(d):
    return table(d["summary"], [
        ("dataset", "dataset", ""), ("n", "n", ","), ("d", "D", "d"), ("K", "K", "d"),
        ("cert", "certificate", ""), ("cert_ratio", "max (J−F)/(TW log K)", ".5f"),
        ("cert_ent_ratio", "entmax: max gap / bound", ".4f"),
        ("tc2", "T_c found / 2λ_max (K=2)", ".4f"),
        (lambda r: r["tcK"] if isinstance(r["tcK"], str) else format(r["tcK"], ".4f"),
         "same, dataset K", ""),
        ("tc2g", "growth estimate", ".6f"), ("dmin_rel", "Δ_min / median d", ".2e"),
        ("slope", "fitted slope / Δ_min", ".3f"), ("corr", "corr(log dist, log Σe^(−Δ/T))", ".4f"),
        ("ent", "entmax exact at 0.9, moved at 1.1 ×Δ_min/2", ""),
        ("ent_strict", "same at 0.99 / 1.01", ""), ("sec", "s", ".1f")]) + machine_line(
        d["machine"])


def r_settle(d):
    """``study_settle.py``: the default fit with and without the settled end."""
    def quality(s):
        if "ari_on" in s:
            return f"ARI {s['ari_off']:.4f} → {s['ari_on']:.4f}"
        return f"CI = 0: {s['ci0_off']} → {s['ci0_on']}"

    def settled(s):
        step = s.get("settled_step")
        return f"{s['settled']}/{s['seeds']}" + (f" (step {step:.0f})" if step is not None else "")
    return table(d["summary"], [
        ("dataset", "data", ""),
        (lambda s: f"{s['obj_rel_median']:.6f} / {s['obj_rel_max']:.6f}",
         "objective on/off (median / worst)", ""),
        (lambda s: f"{s['worse_1e4']} / {s['better_1e4']}", "seeds worse / better by > 1e-4", ""),
        (quality, "quality off → on", ""), (settled, "settled (median step)", ""),
        (lambda s: f"{s['passes_off']:.1f} → {s['passes_on']:.1f}", "passes off → on", ""),
        ("time_ratio", "time on/off", ".2f")]) + machine_line(d.get("machine"))


RENDERERS = {"study_settle": r_settle, "study_theory": r_theory, "bench_regimes": r_regimes, "study_hardening": r_hardening, "bench_kernels": r_kernels, "bench_quality": r_quality, "bench_dask": r_dask,
             "gpu_check": r_gpu, "study_hubness": r_hubness, "bench_peers": r_peers}


def register(name):
    def deco(fn):
        RENDERERS[name] = fn
        return fn
    return deco


def render_all():
    # study modules may add renderers (study_theory.render_md, study_hardening.render_md)
    import importlib
    import sys
    sys.path.insert(0, str(HERE))
    for mod in ("study_theory", "study_hardening"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "render_md"):
            RENDERERS[mod] = m.render_md
    out = {}
    for name, fn in RENDERERS.items():
        d = load(name)
        if d is not None:
            out[name] = fn(d)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args(argv)
    tables = render_all()
    if args.print:
        for k, v in tables.items():
            print(f"## {k}\n\n{v}\n")
        return
    text = DOC.read_text()
    missing = []
    for name, md in tables.items():
        pat = re.compile(rf"(<!-- BEGIN {name} -->\n)(?:.*?\n)?(<!-- END {name} -->)", re.S)
        if not pat.search(text):
            missing.append(name)
            continue
        text = pat.sub(lambda m: m.group(1) + md + "\n" + m.group(2), text)
    tmp = DOC.with_name(DOC.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)
    print(f"updated {DOC}" + (f"; no markers for {missing}" if missing else ""))


if __name__ == "__main__":
    main()
