import _peer_threads  # noqa
import sys, time, numpy as np, warnings
import bench_choose_k as B, fastanneal as fa
from fastanneal import choose_k as CK
warnings.simplefilter("ignore")
variant = sys.argv[1]; seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
if variant.startswith("iter"):
    n = int(variant[4:])
    orig = CK.path_on_source
    def p(*a, **k):
        k["max_iter"] = n
        return orig(*a, **k)
    CK.path_on_source = p
elif variant.startswith("holds"):
    CK._PathPhase.MAX_HOLDS = int(variant[5:])
elif variant == "nosplithold":
    orig_nt = CK._PathPhase.next_temperature
    def nt(self, st, T, n_split):
        self_kmax = self.k_max
        return orig_nt(self, st, T, 0 if n_split and st.centers.shape[0] < self_kmax and False else n_split)
    CK._PathPhase.next_temperature = nt
fa.suggest_k(np.random.default_rng(0).normal(size=(300,4)), k_max=4, random_state=0)
fa.AnnealedKMeans(4, random_state=0).fit(np.random.default_rng(0).normal(size=(300,4)))
hits=0; tot=0; ratios={}
for seed in range(int(sys.argv[3]) if len(sys.argv) > 3 else 0, seeds):
    for name,(X,K,y) in B.make_sets(seed).items():
        if name in ("iris","wine","digits"): continue
        kmax=max(8,2*K)
        t=time.perf_counter(); s=fa.suggest_k(X,k_max=kmax,random_state=seed); ts=time.perf_counter()-t
        t=time.perf_counter(); fa.AnnealedKMeans(kmax,random_state=seed).fit(X); tf=time.perf_counter()-t
        hits += s.best==K; tot+=1
        ratios.setdefault(name,[]).append(ts/tf)
        if s.best!=K: print("  miss", name, seed, s.best, K, flush=True)
print(variant, f"hits {hits}/{tot}", " ".join(f"{k}:{np.median(v):.2f}" for k,v in ratios.items()), flush=True)
