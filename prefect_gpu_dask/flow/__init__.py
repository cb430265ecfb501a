"""What runs in the flow process: the runner and everything it decides and reports.

Modules here may ship code of ``scheduler/`` and ``worker/`` to those processes (a
plugin to register, a function for ``client.run``, a wrapper that travels inside a
task); nothing in those folders imports from here.
"""
