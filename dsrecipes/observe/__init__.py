"""What a person sees of a run: per-step metrics and progress, trackers, plots, the closing report and sweep
summaries.
"""
