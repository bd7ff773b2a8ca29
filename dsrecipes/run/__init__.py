"""The launching wing: from a validated config to a written run directory and running ranks - entry, preflight,
resolving the model, the resume contract, DeepSpeed JSON, requeue, estimates, the doctor, and `launch/` (one
command builder per launcher, process supervision). It never imports torch, deepspeed or transformers' model code
(tests/test_architecture.py imports every module here in a fresh process and checks).
"""
