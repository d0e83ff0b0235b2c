"""The files of a sweep's folder besides its state file and Tune experiment: what
:func:`dpivon.search.sweep_report.report_sweep` writes and ``dpivon export`` reads."""

TRIALS_FILE = "trials.csv"
FRONT_FILE = "pareto_front.csv"
TUNING_FILE = "tuning_privacy.json"
# The trial counts and compositions a hidden-K report leaves out: the sweep's folder only
PRIVATE_TUNING_FILE = "tuning_private.json"
PNG_FILE = "pareto.png"
HTML_FILE = "pareto.html"
