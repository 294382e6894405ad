"""Jobs: what ``python -m kvrl.run`` starts, one flat top-to-bottom module per job.

Each module has ``main(cfg)`` and reads like a short script with section comments; the
library below it (algorithms, engines, workers, environments) never imports a job. The
table of jobs, with the config sections each checks, is ``kvrl.config.JOBS``.
"""
