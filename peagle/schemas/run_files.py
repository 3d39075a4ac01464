"""Names of the files in a training run directory that more than one layer reads.

Training writes them (peagle/stages/train/), eval reads a run's metrics for its report
(peagle/stages/eval/report.py) and the trackers read them to log eval's figures at the run's last
step (peagle/pipeline/tracking/); each name is written here once, so a rename cannot leave one
reader looking for the old file.
"""

METRICS_FILE = "metrics.jsonl"
"""One JSON line per logged step and per evaluation (peagle/stages/train/metrics_file.py)."""

BAD_STEPS_FILE = "bad_steps.jsonl"
"""One line per skipped non-finite step and its samples (peagle/stages/train/bad_steps.py)."""
