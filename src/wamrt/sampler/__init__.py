"""Flow-matching samplers for Cosmos 3: schedules, graph-capturable UniPC/Euler/distilled steps, CFG."""

from ._common import SamplerPlan
from .cfg import cfg_combine, guidance_active
from .distilled import (
    Anchor,
    BoundDistilledPlan,
    DistilledPlan,
    DistilledSchedule,
    DistilledStepCoeffs,
    distilled_plan,
    distilled_step,
    draw_step_noise,
    make_anchor,
)
from .euler import EulerPlan, euler_plan, euler_step
from .loop import Velocity, denoise
from .schedules import (
    FlowSchedule,
    ScheduleKind,
    diffusers_flow_schedule,
    flow_schedule,
    framework_flow_schedule,
    native_flow_schedule,
    schedule_from_sigmas,
)
from .unipc import UniPCHistory, UniPCPlan, UniPCStepCoeffs, predictor_orders, unipc_plan, unipc_step

__all__ = [
    "Anchor",
    "BoundDistilledPlan",
    "DistilledPlan",
    "DistilledSchedule",
    "DistilledStepCoeffs",
    "EulerPlan",
    "FlowSchedule",
    "SamplerPlan",
    "ScheduleKind",
    "UniPCHistory",
    "UniPCPlan",
    "UniPCStepCoeffs",
    "Velocity",
    "cfg_combine",
    "denoise",
    "diffusers_flow_schedule",
    "distilled_plan",
    "distilled_step",
    "draw_step_noise",
    "euler_plan",
    "euler_step",
    "flow_schedule",
    "framework_flow_schedule",
    "guidance_active",
    "make_anchor",
    "native_flow_schedule",
    "predictor_orders",
    "schedule_from_sigmas",
    "unipc_plan",
    "unipc_step",
]
