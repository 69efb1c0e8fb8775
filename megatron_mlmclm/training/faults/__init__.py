"""What goes wrong in a run and how it is survived: the fault monitor (monitor.py: non-finite steps
and their re-run, the spike policy, stragglers), its hang watchdog (watchdog.py), stop signals
(preemption.py) and the fault-injection hook (inject.py)."""
