"""The OpenAPI 3.1 description of the HTTP surface, served at /openapi.json (schemathesis reads it)."""

from __future__ import annotations

from typing import Any

from .. import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}
_ARRAY = {"oneOf": [
    {"type": "array"},
    {"type": "object", "required": ["b64"],
     "properties": {"b64": {"type": "string"}, "dtype": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
]}
_OBSERVATION = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string"},
        "observation/image": _ARRAY, "observation/wrist_image_left": _ARRAY,
        "observation/exterior_image_1_left": _ARRAY, "observation/exterior_image_2_left": _ARRAY,
        "observation/joint_position": {"type": "array"}, "observation/gripper_position": {},
        "session_id": {"type": "string"}, "seed": {"type": "integer", "minimum": 0},
        "endpoint": {"enum": ["infer", "reset"]}, "reset": {"type": "boolean"},
        "timestamp": {"type": "number"}, "max_age_ms": {"type": "number"}, "embodiment": {"type": "string"},
        "action_prefix": {"type": "array", "maxItems": 16, "description": "[d, 8] rows the robot executes while "
                          "this request is in flight (robot space, as the reply's rows); the reply's rows 0..d-1 "
                          "repeat them and the rest continue from them"},
        "action_prefix_mode": {"enum": ["auto", "clean", "inpaint"], "description": "auto: clean when the checkpoint "
                               "was trained with action prefixes, else inpaint"},
        "params": {"type": "object", "properties": {
            "num_steps": {"type": "integer", "minimum": 1, "maximum": 1000}, "guidance": {"type": "number"},
            "shift": {"type": "number"}, "structured": {"type": "boolean"}}},
    },
}


_DISTILLED_STEPS = "on a distilled checkpoint: its schedule's step count (the default); any other is refused"
_DISTILLED_FIXED = "on a distilled checkpoint: ignored (guidance 1, the schedule's sigmas), said in metadata.notes"
_UPSAMPLE = ("generation: the Reasoner first rewrites the prompt as a structured JSON scene caption, which conditions "
             "the generator; the reply's metadata.upsampled_prompt carries it (images: revised_prompt too)")


_VIDEO_FORM = {
    "type": "object", "required": ["prompt"],
    "description": "A policy / forward-dynamics / inverse-dynamics job when extra_params.action_mode says so or "
                   "extra_params carries a policy input (robot_obs, observation, action, session_id, domain_name, "
                   "domain_id, raw_action_dim, action_chunk_size, guidance_interval, action_prefix, "
                   "action_prefix_mode); otherwise world generation (text / image / video -> video, optionally with "
                   "sound).",
    "properties": {
        "prompt": {"type": "string"}, "model": {"type": "string"}, "negative_prompt": {"type": "string"},
        "seed": {"type": "integer", "minimum": 0},
        "num_inference_steps": {"type": "integer", "minimum": 1, "description": _DISTILLED_STEPS},
        "guidance_scale": {"type": "number", "description": _DISTILLED_FIXED},
        "flow_shift": {"type": "number", "description": _DISTILLED_FIXED},
        "size": {"type": "string", "description": "WIDTHxHEIGHT; generation: multiples of 16 (default 1280x720)"},
        "width": {"type": "integer", "minimum": 1}, "height": {"type": "integer", "minimum": 1},
        "seconds": {"type": "string"},
        "num_frames": {"type": "integer", "minimum": 1, "description": "generation: 4k + 1 (default 189)"},
        "fps": {"type": "number", "description": "generation: default 24"},
        "generate_sound": {"type": "boolean", "description": "generation: also generate sound (AAC in the MP4); "
                           "needs a checkpoint with sound heads and a sound tokenizer"},
        "sound_duration": {"type": "number", "description": "seconds; must be the clip's num_frames / fps"},
        "max_sequence_length": {"type": "integer", "minimum": 1, "description": "accepted, ignored"},
        "extra_params": {"type": "string", "description": "JSON object. Action jobs: action_mode (policy | "
                         "forward_dynamics | inverse_dynamics), domain_name/domain_id, action_chunk_size, "
                         "raw_action_dim, robot_obs/observation, action, video, image_size, view_point, num_steps, "
                         "guidance, shift, guidance_interval, session_id, action_prefix ([d, 8]), action_prefix_mode. "
                         "Generation: use_resolution_template, "
                         "use_duration_template, use_system_prompt (booleans), condition_frame_indexes_vision "
                         "(latent frame indexes), condition_video_keep (first | last), guardrails, flow_shift, "
                         "max_sequence_length, video"},
        "input_reference": {"type": "string", "format": "binary",
                            "description": "image (policy, FD, image -> video) or video (ID, video -> video)"},
        "image_reference": {"type": "string", "description": 'JSON {"image_url": "data:..."}'},
        "video_reference": {"type": "string", "description": 'JSON {"video_url": "data:..."}'},
        "upsample_prompt": {"type": "boolean", "description": _UPSAMPLE},
    },
}
_IMAGE_BODY = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string"}, "model": {"type": "string"}, "n": {"type": "integer", "minimum": 1},
        "size": {"type": "string", "description": "WIDTHxHEIGHT, multiples of 16 (default 1024x1024)"},
        "response_format": {"enum": ["b64_json"]}, "user": {"type": "string"},
        "negative_prompt": {"type": "string"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "description": _DISTILLED_STEPS},
        "guidance_scale": {"type": "number", "description": _DISTILLED_FIXED},
        "flow_shift": {"type": "number", "description": _DISTILLED_FIXED},
        "seed": {"type": "integer", "minimum": 0},
        "upsample_prompt": {"type": "boolean", "description": _UPSAMPLE},
    },
}
_CHAT_PART = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "image_url", "video_url"]}, "text": {"type": "string"},
    "image_url": {"type": "object", "properties": {"url": {"type": "string", "description": "a data: URL"}}},
    "video_url": {"type": "object", "properties": {"url": {"type": "string", "description": "a data: URL"}}}}}
_CHAT_BODY = {
    "type": "object", "required": ["messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                     "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                                    "content": {"oneOf": [{"type": "string"},
                                                          {"type": "array", "items": _CHAT_PART}]}}}},
        "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "seed": {"type": "integer"}, "stream": {"type": "boolean"}, "ignore_eos": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    },
}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
_VIDEO_BODY = {"multipart/form-data": {"schema": _VIDEO_FORM}, "application/json": {"schema": _VIDEO_FORM}}
_MP4 = {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}


def _openai_errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "typed error (OpenAI's shape)",
                     "content": {"application/json": {"schema": _OPENAI_ERROR}}} for c in codes}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "typed error", "content": {"application/json": {"schema": _ERROR}}}
            for c in codes}


def openapi_spec() -> dict[str, Any]:
    json_ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "wamrt policy server", "version": __version__},
        "paths": {
            "/v1/policy/infer": {"post": {
                "summary": "One observation -> one action chunk",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _OBSERVATION},
                    "application/msgpack": {"schema": _OBSERVATION}}},
                "responses": {"200": json_ok, **_errors(400, 401, 413, 415, 422, 429, 500, 503)}}},
            "/v1/policy/metadata": {"get": {"summary": "Handshake metadata", "responses": {"200": json_ok}}},
            "/v1/metadata": {"get": {"summary": "Handshake metadata (with `reasoner`: chat, vision or text only)",
                                     "responses": {"200": json_ok}}},
            "/v1/chat/completions": {"post": {
                "summary": "OpenAI chat completions on the Reasoner (stream: server-sent events)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT_BODY}}},
                "responses": {"200": {"description": "OK", "content": {
                    **json_ok["content"], "text/event-stream": {"schema": {"type": "string"}}}},
                    **_openai_errors(400, 401, 404, 413, 429, 499, 500, 503)}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/readyz": {"get": {"summary": "Readiness (after warm-up)",
                                "responses": {"200": json_ok, "503": json_ok}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/v1/models": {"get": {"summary": "Served model", "responses": {"200": json_ok}}},
            "/v1/videos": {
                "get": {"summary": "List jobs", "responses": {"200": json_ok}},
                "post": {"summary": "Queue a policy / forward-dynamics / inverse-dynamics / world-generation job",
                         "requestBody": {"required": True, "content": _VIDEO_BODY},
                         "responses": {"200": json_ok, **_errors(400, 401, 413, 429, 500, 503)}},
            },
            "/v1/videos/sync": {"post": {
                "summary": "Run a job and answer at once (forward dynamics / generation: the MP4, or JSON with Accept)",
                "requestBody": {"required": True, "content": _VIDEO_BODY},
                "responses": {"200": {"description": "OK", "content": {**json_ok["content"], **_MP4}},
                              **_errors(400, 401, 413, 422, 429, 499, 500, 503)}}},
            "/v1/videos/{video_id}": {
                "parameters": [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "Job record", "responses": {"200": json_ok, **_errors(404)}},
                "delete": {"summary": "Cancel an unfinished job (kept as status cancelled) or delete a finished one",
                           "responses": {"200": json_ok, **_errors(404)}},
            },
            "/v1/videos/{video_id}/content": {
                "parameters": [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "FD / generation MP4 (empty for action-only jobs; 409 until completed)",
                        "responses": {"200": {"description": "OK", "content": _MP4}, **_errors(404, 409)}},
            },
            "/v1/images/generations": {"post": {
                "summary": "Text -> image (vLLM-Omni / OpenAI images API): PNGs as b64_json",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _IMAGE_BODY}}},
                "responses": {"200": json_ok, **_errors(400, 401, 413, 429, 499, 500, 503)}}},
        },
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["type", "code", "message"],
            "properties": {"type": {"const": "error"}, "code": {"type": "string"}, "message": {"type": "string"},
                           "field": {"type": "string"}, "request_id": {"type": "string"}}}}},
    }
