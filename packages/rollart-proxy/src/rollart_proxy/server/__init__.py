"""OpenAI-compatible HTTP endpoint served by the proxy (FastAPI + uvicorn, bound to 127.0.0.1).

Black-box agents (anything speaking the OpenAI API) are trained through it: every call made with
a session header (``X-Session-Id: <trajectory id>``) is routed as one turn of that trajectory
(sticky worker, task pool from ``X-Rollart-Task``) and recorded with its prompt token ids, output
token ids, logprobs and the policy version of every token, for the trainer to fetch.

Endpoints:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` too), ``GET /v1/models``
- ``POST /v1/responses`` (OpenAI Responses) and ``POST /v1/messages`` (Anthropic Messages), streaming
  too: translated to the chat request and served by the chat path (same sessions, access, limits,
  recording and token-exact splicing), errors in each dialect's shape (:mod:`.responses_api`,
  :mod:`.messages_api`, :mod:`.dialect`)
- ``GET /v1/sessions/{id}`` (records of a session), ``POST /v1/sessions/{id}/drain`` (take them),
  ``POST /v1/sessions/{id}/abort`` (abort the trajectory's in-flight request),
  ``DELETE /v1/sessions/{id}`` (end the session: records and stickiness dropped),
  ``POST /v1/sessions/{id}/bind`` (a token that may call only this session, for an agent's client) and
  ``POST /v1/sessions/{id}/release`` ``{"token"}`` (revoke it: the session's calls and refusals)
- ``n > 1`` on a call without a session header: ``n`` samples of the prompt as ``n`` sibling
  trajectories of one group (the group-relative advantage then works for single-turn black-box
  clients): the reply has ``n`` choices and ``rollart.group_id``; each choice is recorded under its own
  session ``<group_id>-<i>`` (``rollart.sessions``; the client may continue it as a session).
  ``GET /v1/groups/{id}`` / ``POST /v1/groups/{id}/drain`` (the siblings' records, in choice order;
  :func:`~rollart_proxy.server.sessions.group_trajectories` turns them into the trainer's trajectories).
  Refused (400): ``n > 1`` with a session header (one call is one turn of one trajectory), above the
  server's ``max_n``, with ``stream`` or an enforced ``tool_choice``. Recorded only when all ``n``
  choices were generated.
- ``POST /admin/suspend``, ``POST /admin/resume``, ``POST /admin/update_weights`` ``{"version"}``,
  ``GET /admin/weight_versions``, ``GET /metrics`` (per worker), ``GET /health``

Bad input gets a 4xx with an OpenAI-style ``{"error": {"message", "type", "code"}}`` body: unknown
model 404, malformed body / invalid sampling parameters / prompt longer than the context 400, a body
over ``max_body_bytes`` 413. A request no worker can serve gets 503; one refused because every
worker's queue is full gets 429. Streaming responses are well-formed SSE.

Closed by default:

- **Bind**: 127.0.0.1 unless told otherwise; binding beyond loopback without an API key logs a WARNING.
- **API keys** (``api_key``, or env ``ROLLART_PROXY_API_KEY``, comma-separated for several clients):
  when set, every endpoint (``/health`` included) needs ``Authorization: Bearer <key>`` (401 without).
- **Admin** (``/admin/*``): needs the admin token (``admin_key`` or env ``ROLLART_PROXY_ADMIN_KEY``;
  it is also accepted on every other endpoint). Without an admin token, admin endpoints answer 403,
  unless the server was made with ``enable_admin=True`` (``--enable-admin``) *and* binds a loopback
  address: then they take the API key, if any (a non-loopback bind with that setting is refused).
- **Sessions** belong to the key whose request created them: reading, draining, aborting, deleting
  or adding turns to a session needs that key or the admin token (403 otherwise). Without API keys
  every client is the same anonymous principal.
- **Bounded**: bodies (413) and the time to send one (``body_timeout_s``: 408), the proxy's queues
  (429), and sessions (``max_sessions``): ownership is never lost while a session exists; a new
  session beyond the bound replaces one idle for ``session_ttl_s`` (it goes whole: owner, records,
  routing; its id stays its owner's) or gets 429. Every number at the edge: ``seed`` a signed 64-bit
  integer (as vLLM's server), ``max_tokens`` at most the context (clamped to the room the prompt
  leaves), token ids (prompt, ``stop_token_ids``, ``allowed_token_ids``) in the vocabulary; else 400
  naming the field. Chat templating and (de)tokenisation of long inputs and outputs run in
  worker threads (a typical turn's stay on the loop: the tokenizer holds the GIL, so a thread only
  adds its hop; see ``responses.INLINE_CHARS``).

Modules: :mod:`.app` (:class:`OpenAIServer`: the routes, serving), :mod:`.calls` (the call path),
:mod:`.admission` (a call's checks), :mod:`.models` (request bodies), :mod:`.responses` (JSON and
server-sent-event answers), :mod:`.sessions` (:class:`SessionRecorder`), :mod:`.guard` (access
checks, the ASGI guard, error bodies), and the helpers only the server uses: :mod:`.chat_template`,
:mod:`.chat_tokens` (token-exact multi-turn prompts), :mod:`.tools` (tool calls), :mod:`.forced_call`
(enforced calls over ``enum`` arguments); the dialects :mod:`.responses_api` and :mod:`.messages_api`
over :mod:`.dialect`.
"""

from rollart_core.extras import require

INSTALL = "pip install 'rollart-proxy[server]'"
for _module in ("fastapi", "jinja2", "jsonschema"):  # a missing one names the extra, not a traceback
    require(_module, INSTALL)

from rollart_proxy.server.app import ADMIN_KEY_ENV, API_KEY_ENV, OpenAIServer  # noqa: E402
from rollart_proxy.server.sessions import SessionRecorder, group_trajectories  # noqa: E402

__all__ = ["API_KEY_ENV", "ADMIN_KEY_ENV", "INSTALL", "OpenAIServer", "SessionRecorder", "group_trajectories"]
