"""One step run: its setup from a `StepSpec` (`setup`), the tracked forward, backward and optimizer step
cut into phases (`tracked`), its protocol (`protocol`), the meta-device dispatch mode that makes simulated
steps fast (`simulation_mode`) and its timed repeats (`timing`). The same code runs simulated and measured
steps."""
