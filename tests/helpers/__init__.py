"""What the tests share and the scripts they launch, none of them a test: the scripted runs and tiny settings
(scripted.py), the naive loops of the GRPO math (naive.py), the float32 equality bounds (compare.py), the launcher and
stand-in servers (net.py), reward modules that worker processes import by name, and the scripts that
`accelerate launch` or a subprocess runs (*_update.py, resume_run.py, vllm_*_processes.py). Their accelerate configs
are in tests/configs/."""
