"""kvrl: train KV-cache compression policies for reasoning LLMs with reinforcement learning.

The package is in layers, lowest first. A module imports from its own layer or lower ones,
never from a higher one (``tests/test_layers.py`` reads this table and checks every import
of every module, lazy ones included):

    1. budget runlog kernels section  the KV budget's rules; output directories (metrics, atomic saves,
                          plots); torch ops and attention functions; what a config section is (checked
                          fields, ConfigError, the registry)
    2. policies           what a per-(layer, KV head) cache keeps: the policy zoo, head allocation
    3. cache              the compacting KV cache for transformers and the eviction trace
    4. envs               tasks and rewards, the eviction MDP; no model is ever loaded here
    5. models             the tiny reasoner and model loading
    6. engines            generate() and score(): the HF reference engine and the vLLM plugin
    7. data               data sets built from a model's outputs (traces, self-distillation)
    8. algos              what is trained, the loss, what is pushed to the rollout workers
    9. workers integrations  Ray actors (rollout workers, learners) and the controller loop; kvrl inside
                          other trainers (TRL's GRPOTrainer under a kvrl eviction policy)
   10. eval bench         evaluation under KV budgets; what the scripts under benchmarks/ share (models,
                          tasks, clocks, the JSON line)
   11. preflight jobs     what runs before anything heavy (what the config names, looked up; the checks of
                          a run against this machine; the dry-run plan); what ``python -m kvrl.run`` starts,
                          one module per job (with its config section)
   12. config             the typed config: recipes and command line merged over the shared sections and the
                          sections the algorithms and jobs register, and its checks
   13. run                the entry point
"""

__version__ = "0.1.0"
