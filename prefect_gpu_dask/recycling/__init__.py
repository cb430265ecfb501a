"""The restart path, in one place: drain -> hand back queued work -> move results ->
restart -> wait for the old process's GPU memory.

It spans the three processes: ``flow`` (the ``Recycler`` the runner wires: reasons in,
``RestartRecord``s out), ``scheduler`` (safe-point checks, hand-back, restart, and the
lost-worker plugin) and ``worker`` (drain, resume, the memory wait, refusing a task
run whose worker died).
"""
