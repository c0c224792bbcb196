"""What a reader of GRPO may skip: the code a real run needs around the reading path (train.py,
rollout.py, grpo.py, replay.py). Nothing here imports train.py.

  models      load and save the policy (FSDP, DDP, compile, LoRA, meta load from rank 0)
  prompts     chat templates, prompt ids, end tokens, and the advice when a template fails
  logprobs    the chunked float32 output layer and the shared-prompt KV pass
  gate        DGG's gradient gate on reuse passes
  parallel    the process group, collectives on host tensors, FSDP's gathered weights
  preempt     stopping at any moment (SIGTERM, SIGINT) and rewinding a step
  rundir      the run folder: its lock, --overwrite, atomic writes, what a resume rewrites
  checkpoint  checkpoints, resume, the run's end
  integrity   whole or refused: checkpoint manifests, trainer state fields, model folders
  replay_state  the replay buffer in a checkpoint, and re-split for another number of processes
  checks      memory and token budgets of a config
  vllm        the vLLM sampler
  lora        LoRA adapters through peft
  compare     comparing runs by arm (eval.py --compare), with `stats` and `compare_io` (its files)
  greso       GRESO's prompt skipping (skip.*): prompts whose groups were flat are skipped
  stages      staged rollouts (stages.first): g1 samples first, the rest only where they teach
  util        the bad-input error, one-line messages, timers, RNG streams as plain values
"""
