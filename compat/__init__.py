"""Drop-in legacy APIs served by meshgroups.

- ``compat.group_initializer``: the ``rlightning.utils.distributed.group_initializer`` classes.
- ``compat.parallel_state`` and ``compat.process_groups_config``: Megatron-style parallel state
  and ``ModelCommProcessGroups`` / ``GradCommProcessGroups``.
"""
