"""Drop-in legacy APIs served by meshgroups.

- ``meshgroups.compat.group_initializer``: the ``rlightning.utils.distributed.group_initializer`` classes.
- ``meshgroups.compat.parallel_state`` and ``meshgroups.compat.process_groups_config``: Megatron-style parallel state
  and ``ModelCommProcessGroups`` / ``GradCommProcessGroups``.
"""

# The package itself exports nothing: each module above is a drop-in under its legacy path.
__all__: list[str] = []
