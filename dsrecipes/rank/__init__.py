"""The rank wing: what runs in every rank process - the worker entry, the training loop, checkpoints, the step
guard, the schedule, evaluation, best-checkpoint selection, prompt-eval during training and writing an export. torch
and deepspeed are imported here freely; the launching wing never imports this folder.
"""
