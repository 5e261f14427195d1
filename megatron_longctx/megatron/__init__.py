"""Everything that knows Megatron-Core: the core_attention module, the spec transform, flags, launcher.

* :class:`~megatron_longctx.megatron.core_attention.ContextParallelAttention` — Megatron's ``core_attention``;
* :func:`~megatron_longctx.megatron.spec.apply_to_spec` — put it into any layer/block/stack spec;
* :func:`~megatron_longctx.megatron.arguments.add_longctx_args` / ``config_from_args`` — the ``--longctx-*`` flags;
* :func:`~megatron_longctx.megatron.batch.get_batch_on_this_cp_rank` — Megatron's CP batch split, any version;
* :mod:`~megatron_longctx.megatron.launch` — run an unmodified Megatron-LM script with the plugin;
* :mod:`~megatron_longctx.megatron.script_hooks` — what the ``patches/`` diffs call from an edited script;
* :mod:`~megatron_longctx.megatron.script_setup` — what every way of running a Megatron-LM script sets up.
"""
