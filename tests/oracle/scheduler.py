"""diffusers' flow UniPC in the configuration Cosmos 3 uses (the sampler oracle)."""

from __future__ import annotations

from diffusers import UniPCMultistepScheduler


def reference_unipc(shift: float = 5.0) -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(
        num_train_timesteps=1000,
        solver_order=2,
        prediction_type="flow_prediction",
        predict_x0=True,
        solver_type="bh2",
        lower_order_final=True,
        use_flow_sigmas=True,
        flow_shift=shift,
        use_karras_sigmas=False,
        final_sigmas_type="zero",
    )
