"""Short cluster labels by class-based TF-IDF (c-TF-IDF) over the queries.

All queries of a cluster are treated as one document. A term's weight in cluster ``c`` is

    w(t, c) = tf(t, c) / |c| * log(1 + A / f(t))

``tf(t, c)`` the (sample-weighted) count of ``t`` in the cluster, ``|c|`` the cluster's total
(weighted) term count, ``f(t)`` the count of ``t`` over all clusters and ``A`` the mean number
of terms per cluster (Grootendorst 2022, BERTopic). Frequent-everywhere terms ("what", "my",
"is") score low without a stop-word list; a small one still removes the worst of them.
Pure Python (``collections``) + NumPy; no scikit-learn at run time.
"""
import math
import re
import sys
import unicodedata
from collections import Counter

import numpy as np

__all__ = ["tokenize", "ctfidf_terms", "cluster_labels", "TermCounts", "short_labels"]

_TOKEN = None


def _token_re():
    """Word tokens: a letter or digit, then letters, digits, combining marks (the vowel
    signs and viramas of Indic scripts, Arabic harakat, Thai vowels: without them
    Hindi queries gave no token at all and Thai words broke apart) and inner apostrophes
    or hyphens. Python's ``re`` has no ``\\p{M}``: the marks of the Basic Multilingual
    Plane are gathered once, on the first call (a few ms)."""
    global _TOKEN
    if _TOKEN is None:
        ranges, start, prev = [], None, None
        for c in range(0x300, 0x10000):
            if unicodedata.category(chr(c))[0] == "M":
                if start is None:
                    start = c
                prev = c
            elif start is not None:
                ranges.append((start, prev))
                start = None
        if start is not None:
            ranges.append((start, prev))
        marks = "".join(f"\\u{a:04x}-\\u{b:04x}" if b > a else f"\\u{a:04x}" for a, b in ranges)
        # (and: a decimal mark or thousands separator between digits, "1,000" / "3.50"
        # were "000" / "50"; "&" between letters, "at&t"; a closing "++" or "#", "c++",
        # "c#": those gave no token at all)
        _TOKEN = re.compile(rf"[^\W_](?:[^\W_]|[{marks}]|['-](?=[^\W_])|(?<=\d)[.,](?=\d)"
                            rf"|&(?=[^\W_]))*(?:\+\+|#)?", re.UNICODE)
    return _TOKEN

#: Function words that never make a useful label (English; short on purpose).
STOP_WORDS = frozenset("""
a about above after again all am an and any are as at be been being below between both but by
can could did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself
no nor not now of off on once only or other our ours ourselves out over own please same she
should so some such than that the their theirs them themselves then there these they this those
through to too under until up very was we were what when where which while who whom why will
with would you your yours yourself yourselves i'm i'd i've you're can't don't it's what's
get give know let like much need tell want
""".split())


#: Chinese and Japanese (Han, kana) are written without spaces between words: a run of
#: them is no word but a phrase, and is cut into overlapping character bigrams (the usual
#: CJK analysis of search engines; most Chinese words have two characters). Thai, Lao,
#: Khmer and Myanmar are too, but their words are longer than two characters and need a
#: dictionary: a run of them stays one token (words separated by spaces are tokens).
_NO_SPACE = re.compile("[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
                       "\uf900-\ufaff\U00020000-\U0002fa1f]+")


def _split_no_space(tok):
    """``tok`` with each run of a script without spaces cut into character bigrams (a
    lone character stays, and the length rule drops it); other parts are kept whole."""
    if not _NO_SPACE.search(tok):
        return [tok]
    out, pos = [], 0
    for m in _NO_SPACE.finditer(tok):
        if m.start() > pos:
            out.append(tok[pos:m.start()])
        # (units: a base character with the combining marks after it -- the kana voicing
        # marks of decomposed text -- so that no bigram starts with a mark)
        units = []
        for c in m.group():
            if units and unicodedata.category(c)[0] == "M":
                units[-1] += c
            else:
                units.append(c)
        out.extend(["".join(units)] if len(units) < 2 else
                   [units[i] + units[i + 1] for i in range(len(units) - 1)])
        pos = m.end()
    if pos < len(tok):
        out.append(tok[pos:])
    return out


#: full-width ASCII, half-width katakana and punctuation, Latin ligatures: folded by NFKC
_WIDTH_FORMS = re.compile("[\uff01-\uff5e\uff61-\uff9f\ufb00-\ufb06]+")


def tokenize(text, stop_words=STOP_WORDS):
    """Lower-case word tokens of at least 2 characters (digits kept), minus stop words;
    runs of Chinese or Japanese characters become overlapping character bigrams (no space
    between their words). Thai and the like: words separated by spaces, else a run is one
    token (no dictionary segmenter is bundled)."""
    if not text:
        return []
    # composed forms (a decomposed "café" is the same word); full-width "ＰＡＳＳＷＯＲＤ",
    # half-width katakana (typed by input methods) and the Latin ligatures as their usual
    # letters -- only those: NFKC on everything made "Nike™" "niketm", "x²" "x2" and Korean
    # compatibility jamo conjoining ones, and casefold lost the Greek final sigma; without
    # the Arabic tatweel (a stretching stroke) and with one apostrophe (phones type "don’t":
    # the stop word is "don't")
    text = _WIDTH_FORMS.sub(lambda m: unicodedata.normalize("NFKC", m.group()),
                            unicodedata.normalize("NFC", str(text)))
    text = text.lower().replace("\u0640", "").replace("\u2019", "'")
    toks = _token_re().findall(text)
    if not text.isascii():
        toks = [t for tok in toks for t in _split_no_space(tok)]
    return [t for t in toks if len(t) >= 2 and t not in stop_words]


#: ngram range -> {text: its n-grams}: the tokenizer's cache, shared by the term counts of
#: this process (bounded by ``TermCounts.CACHE`` entries; pure function of the text)
_GRAMS = {}


def _grams_of(text, lo, hi):
    """``(grams, multi)`` of one text: its n-grams (sizes ``lo..hi``) and the distinct
    multi-word ones among them (a bigram counts once per row for the recurrence rule)."""
    toks = tokenize(text)
    plain = text is None or str(text).isascii()         # (no CJK run: no regex per gram)
    grams = []
    for size in range(lo, hi + 1):
        grams.extend(" ".join(toks[i:i + size])
                     for i in range(len(toks) - size + 1)
                     # (not across the overlapping character bigrams of a run without
                     # spaces: "修改 改密" is "修改密" again)
                     if size == 1 or plain or not all(_NO_SPACE.match(t)
                                                      for t in toks[i:i + size]))
    # one string object per distinct n-gram, shared by every cached text that has it
    # (query logs repeat their words: the cache's lists otherwise hold a copy per text)
    grams = tuple([sys.intern(g) for g in grams])
    multi = tuple(dict.fromkeys(g for g in grams if " " in g))
    return grams, multi


class TermCounts:
    """Per-cluster (sample-weighted) counts of unigrams and bigrams, added block by block:
    the streaming form of :func:`ctfidf_terms` (the same counts whatever the blocks)."""

    #: tokenized texts remembered across blocks and across the counts of one process (query
    #: logs repeat a lot; every row group of an out-of-core run has counts of its own)
    CACHE = 200_000

    def __init__(self, n_clusters, ngram_range=(1, 2)):
        self.n_clusters = int(n_clusters)
        self.ngram_range = ngram_range
        self.per_class = [Counter() for _ in range(self.n_clusters)]
        # rows holding each bigram, per cluster (unweighted, once per row): "a bigram must
        # recur" is about rows, not weight (weighted, every one-off bigram of an integer query
        # frequency passed and none of a fractional one: labels changed with the weights'
        # scale)
        self.bigram_rows = [Counter() for _ in range(self.n_clusters)]
        self._cache = _GRAMS.setdefault(tuple(ngram_range), {})

    def add(self, texts, labels, weights=None):
        labels = np.asarray(labels, dtype=np.int64)
        n = labels.shape[0]
        if len(texts) != n:
            raise ValueError(f"{len(texts)} texts but {n} labels")
        w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (n,):
            raise ValueError(f"{w.shape[0] if w.ndim == 1 else w.shape} weights but {n} labels")
        if n and (labels.min() < 0 or labels.max() >= self.n_clusters):
            bad = int(np.flatnonzero((labels < 0) | (labels >= self.n_clusters))[0])
            raise ValueError(f"label {int(labels[bad])} at row {bad} is not a cluster of "
                             f"0..{self.n_clusters - 1}")   # (-1 counted in the last one)
        if not np.isfinite(w).all() or (w < 0).any():
            bad = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
            raise ValueError(f"weight {float(w[bad])!r} at row {bad}: weights must be finite "
                             "and >= 0")
        lo, hi = self.ngram_range
        cache = self._cache
        if len(cache) > self.CACHE:
            cache.clear()
        per_class = self.per_class
        bigram_rows = self.bigram_rows
        for text, lab, wi in zip(texts, labels.tolist(), w.tolist()):
            if wi <= 0:
                continue
            entry = cache.get(text)
            if entry is None:
                if len(cache) >= self.CACHE:        # (the bound holds within a call too)
                    cache.clear()
                entry = cache[text] = _grams_of(text, lo, hi)
            grams, multi = entry
            cnt = per_class[lab]
            for g in grams:
                cnt[g] += wi
            if multi:
                rows = bigram_rows[lab]
                for g in multi:             # (a loop: Counter.update costs ~2 us a call)
                    rows[g] += 1

    def merge(self, other):
        """Add the counts of ``other`` (the counts of other rows): the same counts as one
        :meth:`add` of both row sets, up to the order of the floating-point additions."""
        if other.n_clusters != self.n_clusters or other.ngram_range != self.ngram_range:
            raise ValueError("cannot merge term counts of different clusterings")
        for mine, theirs in zip(self.per_class, other.per_class):
            mine.update(theirs)
        for mine, theirs in zip(self.bigram_rows, other.bigram_rows):
            mine.update(theirs)
        return self

    def __getstate__(self):
        # the tokenizer cache is this process's speed-up, not state: never shipped
        d = dict(self.__dict__)
        del d["_cache"]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        if "bigram_rows" not in d:          # (pickled before rows were counted: weights)
            self.bigram_rows = [Counter({t: v for t, v in cnt.items() if " " in t})
                                for cnt in self.per_class]
        self._cache = _GRAMS.setdefault(tuple(self.ngram_range), {})

    def terms(self, top_n=8):
        """Top ``top_n`` ``(term, score)`` of each cluster (see :func:`ctfidf_terms`)."""
        total = Counter()
        for cnt in self.per_class:
            total.update(cnt)
        sizes = [sum(cnt.values()) for cnt in self.per_class]
        nonempty = [s for s in sizes if s > 0]
        A = (sum(nonempty) / len(nonempty)) if nonempty else 0.0
        out = []
        for cnt, size, rows in zip(self.per_class, sizes, self.bigram_rows):
            if size <= 0:
                out.append([])
                continue
            scored = []
            for term, tf in cnt.items():
                s = tf / size * math.log1p(A / total[term])
                # a bigram must beat being two unigrams: only keep it when it recurs (in
                # two rows of the cluster, whatever their weights)
                if " " in term and rows[term] < 2:
                    continue
                scored.append((s, term))
            # (scores equal but for the order their weighted counts were added in --
            # shuffled rows, Dask's merges -- tie: compared to 12 significant digits, the
            # term decides, whatever the order)
            scored.sort(key=lambda st: (-float(f"{st[0]:.12g}"), st[1]))
            out.append([(t, float(s)) for s, t in scored[:top_n]])
        return out

    def labels(self, n_terms=3, top_n=8):
        """``(short_labels, term_lists)`` as :func:`cluster_labels`."""
        return short_labels(self.terms(top_n=max(top_n, 3 * n_terms)), n_terms, top_n)


def ctfidf_terms(texts, labels, n_clusters, weights=None, top_n=8, ngram_range=(1, 2)):
    """Top ``top_n`` c-TF-IDF terms of each cluster: a list of ``n_clusters`` lists of
    ``(term, score)``; empty clusters (and clusters without any token) get ``[]``.

    ``texts`` strings (None counts as empty), ``labels`` ints in ``[0, n_clusters)``,
    ``weights`` optional per-text counts (query frequencies). Bigrams of consecutive kept
    tokens are candidates next to unigrams when ``ngram_range[1] >= 2``.
    """
    tc = TermCounts(n_clusters, ngram_range)
    tc.add(texts, labels, weights)
    return tc.terms(top_n)


def cluster_labels(texts, labels, n_clusters, weights=None, n_terms=3, top_n=8):
    """``(short_labels, term_lists)``: a short label of up to ``n_terms`` distinctive terms per
    cluster ("change pin / bank / card"), and the longer ``top_n`` term list as a string.

    Labels do not repeat a word: a bigram replaces the chosen unigrams it contains ("pin" ->
    "change pin"), and a term whose words are already used is skipped.
    """
    terms = ctfidf_terms(texts, labels, n_clusters, weights=weights, top_n=max(top_n, 3 * n_terms))
    return short_labels(terms, n_terms, top_n)


#: A bigram replaces chosen unigrams it contains only when its c-TF-IDF score is at least
#: this share of theirs: "weather" (every row of a cluster) stays "weather", not the
#: "weather berlin" of a tenth of its rows; "pin" in mostly "change pin" rows becomes it.
BIGRAM_SHARE = 0.5


def short_labels(terms, n_terms=3, top_n=8):
    """Short labels and term strings from per-cluster ``(term, score)`` lists."""
    short, longer = [], []
    for tl in terms:
        chosen, scores = [], []
        words = set()
        for t, s in tl:
            parts = t.split(" ")
            if len(parts) > 1:
                # a bigram replaces the unigrams it contains ("pin" -> "change pin"; both
                # "red" and "car" -> "red car") when it scores nearly as high
                # (BIGRAM_SHARE), unless it would repeat a word of another chosen term
                inside = [i for i, c in enumerate(chosen) if c in parts]
                mine = {chosen[i] for i in inside}
                if inside and all(p in mine or p not in words for p in parts):
                    if s >= BIGRAM_SHARE * min(scores[i] for i in inside):
                        chosen[inside[0]] = t
                        scores[inside[0]] = s
                        keep = [i for i in range(len(chosen)) if i not in inside[1:]]
                        chosen = [chosen[i] for i in keep]
                        scores = [scores[i] for i in keep]
                        words.update(parts)
                    continue          # (a weaker bigram of a chosen word adds nothing)
            if any(p in words for p in parts):
                continue              # would repeat a chosen word
            words.update(parts)
            if len(chosen) < n_terms:
                chosen.append(t)
                scores.append(s)
            if len(chosen) == n_terms:
                break
        short.append(" / ".join(_clip(t) for t in chosen))
        longer.append(", ".join(_clip(t) for t, _ in tl[:top_n]))
    return short, longer


#: A term longer than this (a 100,000-character "word": a pasted blob) is cut in the label and
#: term cells, with an ellipsis.
MAX_TERM_CHARS = 40


def _clip(t):
    return t if len(t) <= MAX_TERM_CHARS else t[:MAX_TERM_CHARS - 1] + "\u2026"
