"""What a study needs besides the models it trains, shared by ``tjax sweep``, the experiment
scripts and the benchmarks, so that none of them imports another for it:

- ``provenance.py``: the code (commit, uncommitted changes, source digest), libraries and host
  a result came from;
- ``splits.py``: train and held-out documents drawn alike, fixed by a seed;
- ``ngram.py``: the interpolated Kneser-Ney n-gram baseline over token ids;
- ``stats.py``: paired differences, their intervals and p-values, Holm's correction;
- ``workers.py``: several training processes on one host, each on its own cores.
"""
