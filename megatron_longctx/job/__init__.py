"""The main job, ``megatron-longctx run``: long-context GPT training on Megatron-LM's own ``pretrain``.

* :mod:`.pretrain` — the entry: phases, checkpoints, the run's report;
* :mod:`.command_line` — the job's own flags and the Megatron flags it derives;
* :mod:`.spawn` — one phase as ``torchrun`` ranks; :mod:`.worker` — what each rank runs;
* :mod:`.providers` — the model, data (:mod:`megatron_longctx.data`) and forward-step providers Megatron's
  ``pretrain`` calls;
* :mod:`.checkpoint_guard` — integrity manifests and the resume check; :mod:`.report` — the summary.
"""
