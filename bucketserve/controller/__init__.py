"""The control plane: Controller, PDScheduler, Handoff, the worker pool and handles."""
