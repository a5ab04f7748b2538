"""What choosing K costs: ``suggest_k`` and ``AnnealedKMeans("auto")`` against one default fit
at ``k_max`` (the issue's cost target), on the synthetic sets of ``bench_choose_k.py``.

    python benchmarks/bench_choose_k_cost.py

Prints one line per set (seconds, one run each after a warm-up; read loosely).
"""
import _peer_threads  # noqa: F401,I001 -- first: before scikit-learn loads OpenMP
import sys, time, numpy as np, warnings
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import _known_answers as ka, fastanneal
from sklearn import datasets
warnings.simplefilter("ignore")
fastanneal.suggest_k(np.random.default_rng(0).normal(size=(300,4)), k_max=4, random_state=0)
fastanneal.AnnealedKMeans(4, random_state=0).fit(np.random.default_rng(0).normal(size=(300,4)))
sets={}
for name in ("a20","a35","dim32","dim128","unbalanced"):
    X,C=ka.load(name,0)[:2]; sets[name]=(np.asarray(X,float), C.shape[0])
for D,K in ((16,10),(128,12),(1024,8)):
    X,y=datasets.make_blobs(n_samples=150*K,n_features=D,centers=K,center_box=(-10,10),random_state=0); sets[f"blobs-d{D}"]=(X,K)
for name,(X,K) in sets.items():
    kmax=max(8,2*K)
    t=time.perf_counter(); fastanneal.suggest_k(X,k_max=kmax,random_state=0); ts=time.perf_counter()-t
    t=time.perf_counter(); fastanneal.AnnealedKMeans(kmax,random_state=0).fit(X); tf=time.perf_counter()-t
    t=time.perf_counter(); fastanneal.AnnealedKMeans("auto", k_max=kmax,random_state=0).fit(X); ta=time.perf_counter()-t
    print(f"{name:12s} k_max {kmax:3d}  suggest_k {ts:6.2f}s  default fit at k_max {tf:6.2f}s  ratio {ts/tf:5.2f}  auto fit {ta:6.2f}s ({ta/tf:4.2f}x)", flush=True)
