"""An update-side method outside methods/, as README's "How to add a method" shows:
python train.py --config configs/tiny.yaml --optim.epochs=4 --optim.update=kl_stop:update
(with this folder on PYTHONPATH). tests/test_update_custom.py trains with it."""

import grpo


class KLStop:
    """PPO's early stop (target_kl, as in CleanRL's ppo.py and Stable-Baselines3): up to
    optim.epochs passes over the update batch, no pass after one whose mean approximate KL to
    π_old (grpo's approx_kl: E[r − 1 − log r] over its tokens) exceeds `target_kl`. Logs
    kl_stop/passes."""

    def __init__(self, target_kl: float):
        self.target_kl = target_kl

    def __call__(self, s, model, policy, optimizer, batch, device, compute=None, ref=None):
        u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref,
                              s.optim.epochs)
        for k in range(s.optim.epochs):
            grpo.run_pass(u, k)
            # every rank's tokens: the same number, so the same decision, on every rank
            kl = max(step.get("approx_kl", 0.0) for step in u.steps[-s.optim.minibatches :])
            if kl > self.target_kl:
                break
        return grpo.finish_update(u, {"kl_stop/passes": float(k + 1)})


update = KLStop(target_kl=0.02)  # a common PPO setting
first_change = KLStop(target_kl=0.0)  # stops after the first pass that sees the weights moved
