"""What a reader of GRPO may skip: the code a real run needs around the reading path (train.py,
rollout.py, grpo.py, replay.py). Nothing here imports train.py.

  models      load and save the policy (FSDP, DDP, compile, LoRA, meta load from rank 0)
  prompts     chat templates, prompt ids, end tokens, and the advice when a template fails
  logprobs    the chunked float32 output layer (one float32 copy per rollout), the shared-prompt
              KV pass
  kvcache     generation's KV cache, written in place, and its attention without K/V copies
  decode      generation's own decode loop: slots refilled as rows end, few host syncs (refill)
  parallel    the process group, collectives on host tensors, FSDP's gathered weights
  preempt     stopping at any moment (SIGTERM, SIGINT) and rewinding a step
  rundir      the run folder: its lock, --overwrite, atomic writes, what a resume rewrites
  locks       folder locks, never through a link: a run's out_dir, eval.py's results folder
  checkpoint  checkpoints, resume, the summary and the stop note of a run's end
  integrity   whole or refused: checkpoint manifests, trainer state fields, model folders
  replay_state  the replay buffer in a checkpoint, and re-split for another number of processes
  checks      memory and token budgets of a config
  vllm        the vLLM sampler
  lora        LoRA adapters through peft
  util        the bad-input error, one-line messages, timers, RNG streams as plain values
"""
