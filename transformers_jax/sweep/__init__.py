"""``tjax sweep``: an ablation from one TOML spec (``spec.py``), its cells (``cells.py``) made
concrete with their data before anything trains (``plan.py``), trained and scored resumably
(``runner.py``), and reported with every declared comparison Holm-corrected (``stats.py``,
``report.py``). The held-out split and its n-gram baselines: ``splits.py``, ``ngram.py``."""
