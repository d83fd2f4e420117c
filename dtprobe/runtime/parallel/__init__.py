"""The layouts of the built-in GPT: each builds the ``step_api.TrainParts`` the train loop runs.

``ddp`` (pure data parallel: DDP, compression hooks) and ``hybrid`` (any dp x tp x pp x ZeRO layout on one
DeviceMesh: ``parallelize``) are the two builders; the rest are their parts: ``mesh`` (degrees, validation,
DeviceMesh), ``tp``, ``zero`` (DP/ZeRO on the dp axis), ``pp`` (stages, schedules, action timing, sleep stages),
``stage_sleep`` (its torch-free spec), ``ac`` (activation checkpointing), ``grad_norm``, ``memory`` (per-rank
bytes), ``bubble`` (measured vs ideal pipeline bubble). Import the submodule you need; this package imports none.
"""
