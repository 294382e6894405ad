"""Data steps: jobs that build training sets from a model's own outputs.

Each step is a job of ``python -m kvrl.run`` with its own recipe, writes its output under
``output_dir`` with a progress bar, and resumes from what an interrupted run wrote.
"""
