"""Contract fakes of real CRMs, as their published API references describe them: each checks what
the vendor checks (paths, methods, required fields, value types, the token) and answers as the
vendor answers. One threaded local server holds them all:

- HubSpot CRM v3 contacts: `POST /crm/v3/objects/contacts` with `{"properties": {NAME: "string"},
  "associations": [...]}` (both required, property values strings), `PATCH
  /crm/v3/objects/contacts/{id}` with `{"properties": {...}}`; OAuth2 access tokens from `POST
  /oauth/v1/token` (`grant_type=refresh_token`, the client's credentials in the form) that expire
  after `token_lifetime` seconds, refresh tokens rotated when `rotate` is set; a duplicate email 409.
- Salesforce sObjects: `PATCH /services/data/v60.0/sobjects/Contact/External_Id__c/{value}` upserts
  (201 `created: true`, 200 `created: false`), `PATCH .../sobjects/Contact/{id}` 204; client
  credentials from `POST /services/oauth2/token`, answered without `expires_in` (the session ends
  when `expire_sessions()` is called, seen as 401 `INVALID_SESSION_ID`).
- Intercom: `POST /contacts` (flat body, `role` required) and `PUT /contacts/{id}`, with the
  `Intercom-Version: 2.11` header required.
- Zendesk: `POST /api/v2/users` `{"user": {...}}` and `PUT /api/v2/users/{id}`, basic auth.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

CLIENT_ID = "client-id-1"
CLIENT_SECRET = "client-secret-s3cr3t"
REFRESH_TOKEN = "refresh-token-r0-s3cr3t"
API_KEY = "intercom-token-s3cr3t"
ZENDESK_USER = "ops@example.com/token"
ZENDESK_TOKEN = "zendesk-api-token-s3cr3t"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Vendors:
    """The vendors' state, behind one lock."""

    token_lifetime: int | None = 1800
    rotate: bool = False
    #: Seconds each API request (not a token request) takes to answer.
    latency: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[Seen] = field(default_factory=list)
    token_requests: list[dict[str, str]] = field(default_factory=list)
    access: dict[str, float] = field(default_factory=dict)  # access token -> expires at (monotonic)
    refresh_tokens: set[str] = field(default_factory=lambda: {REFRESH_TOKEN})
    hubspot: dict[str, dict[str, Any]] = field(default_factory=dict)
    salesforce: dict[str, dict[str, Any]] = field(default_factory=dict)
    intercom: dict[str, dict[str, Any]] = field(default_factory=dict)
    zendesk: dict[str, dict[str, Any]] = field(default_factory=dict)
    next_id: int = 1001
    revoked: bool = False
    batch_calls: list[tuple[str, int]] = field(default_factory=list)

    def new_id(self) -> str:
        self.next_id += 1
        return str(self.next_id)


class VendorServer:
    def __init__(self, token_lifetime: int | None = 1800, rotate: bool = False) -> None:
        self.state = Vendors(token_lifetime=token_lifetime, rotate=rotate)
        state = self.state

        class Handler(_Handler):
            vendors = state

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> VendorServer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def expire_sessions(self) -> None:
        """Every access token stops working now (a session timeout, an expiry)."""
        with self.state.lock:
            self.state.access.clear()

    def revoke(self) -> None:
        """The refresh token and the client are refused from now on (`invalid_grant`)."""
        with self.state.lock:
            self.state.revoked = True
            self.state.access.clear()


class _Handler(BaseHTTPRequestHandler):
    vendors: Vendors
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = urlsplit(self.path).path
        headers = {k.lower(): v for k, v in self.headers.items()}
        v = self.vendors
        if path in ("/oauth/v1/token", "/services/oauth2/token"):
            form = {k: vs[0] for k, vs in parse_qs(raw.decode()).items()}
            with v.lock:
                v.token_requests.append(form)
            self._reply(*self._token(path, form, headers))
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            self._reply(400, {"message": "invalid JSON"})
            return
        with v.lock:
            v.requests.append(Seen(self.command, path, headers, body))
        if v.latency:
            import time

            time.sleep(v.latency)
        if path.startswith("/crm/v3/objects/"):
            self._reply(*self._hubspot(path, body, headers))
        elif path.startswith("/services/data/"):
            self._reply(*self._salesforce(path, body, headers))
        elif path.startswith("/contacts"):
            self._reply(*self._intercom(path, body, headers))
        elif path.startswith("/api/v2/users"):
            self._reply(*self._zendesk(path, body, headers))
        else:
            self._reply(404, {"message": "not found"})

    # -- tokens ---------------------------------------------------------------------------------

    def _token(self, path: str, form: dict[str, str], headers: dict[str, str]) -> tuple[int, Any]:
        import secrets
        import time

        v = self.vendors
        if headers.get("content-type", "").split(";")[0] != "application/x-www-form-urlencoded":
            return 400, {"error": "invalid_request", "error_description": "form body expected"}
        if form.get("client_id") != CLIENT_ID or form.get("client_secret") != CLIENT_SECRET or v.revoked:
            return 401 if not v.revoked else 400, {"error": "invalid_client" if not v.revoked else "invalid_grant"}
        grant = form.get("grant_type")
        with v.lock:
            if path == "/oauth/v1/token":
                if grant != "refresh_token" or form.get("refresh_token") not in v.refresh_tokens:
                    return 400, {"error": "invalid_grant", "error_description": "missing or unknown refresh token"}
                access = "hs-access-" + secrets.token_hex(8)
                answer: dict[str, Any] = {"access_token": access, "token_type": "bearer"}
                if v.token_lifetime is not None:
                    answer["expires_in"] = v.token_lifetime
                answer["refresh_token"] = form["refresh_token"]
                if v.rotate:
                    v.refresh_tokens.discard(form["refresh_token"])
                    answer["refresh_token"] = "refresh-token-" + secrets.token_hex(8)
                    v.refresh_tokens.add(answer["refresh_token"])
            else:
                if grant != "client_credentials":
                    return 400, {"error": "unsupported_grant_type"}
                access = "sf-access-" + secrets.token_hex(8)
                answer = {"access_token": access, "instance_url": "x", "token_type": "Bearer", "issued_at": "0"}
            lifetime = v.token_lifetime if path == "/oauth/v1/token" else None
            v.access[access] = time.monotonic() + lifetime if lifetime is not None else float("inf")
        return 200, answer

    def _bearer_ok(self, headers: dict[str, str]) -> bool:
        import time

        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            return False
        with self.vendors.lock:
            expires = self.vendors.access.get(auth.removeprefix("Bearer "))
        return expires is not None and time.monotonic() < expires

    # -- the vendors ----------------------------------------------------------------------------

    def _hubspot(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        if not self._bearer_ok(headers):
            return 401, {"status": "error", "category": "EXPIRED_AUTHENTICATION", "message": "expired"}
        parts = path.split("/")  # ['', 'crm', 'v3', 'objects', 'contacts', id?]
        if len(parts) < 5 or parts[4] != "contacts":
            return 404, {"status": "error", "message": "unknown object"}
        if len(parts) == 7 and parts[5] == "batch" and self.command == "POST":
            return self._hubspot_batch(parts[6], body)
        if len(parts) == 6 and self.command == "DELETE":
            if body is not None or "content-type" in headers:
                return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "no body expected"}
            with self.vendors.lock:  # archive: 204, no content
                gone = self.vendors.hubspot.pop(unquote(parts[5]), None)
            return (204, None) if gone is not None else (404, {"status": "error", "category": "OBJECT_NOT_FOUND"})
        properties = body.get("properties") if isinstance(body, dict) else None
        if not isinstance(properties, dict) or not all(isinstance(x, str) for x in properties.values()):
            return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "properties: strings"}
        v = self.vendors
        with v.lock:
            if len(parts) == 5 and self.command == "POST":
                if not isinstance(body.get("associations"), list):
                    return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "associations"}
                email = properties.get("email")
                if any(c["properties"].get("email") == email for c in v.hubspot.values()):
                    return 409, {"status": "error", "category": "CONFLICT", "message": "Contact already exists"}
                new = v.new_id()
                v.hubspot[new] = {"id": new, "properties": dict(properties), "archived": False}
                return 201, {**v.hubspot[new], "createdAt": "2026-12-07T00:00:00Z", "updatedAt": "2026-12-07T00:00:00Z"}
            if len(parts) == 6 and self.command == "PATCH":
                found = v.hubspot.get(unquote(parts[5]))
                if found is None:
                    return 404, {"status": "error", "category": "OBJECT_NOT_FOUND", "message": "not found"}
                found["properties"].update(properties)
                return 200, found
        return 405, {"status": "error", "message": "method not allowed"}

    def _hubspot_batch(self, action: str, body: Any) -> tuple[int, Any]:
        """`batch/create` and `batch/update`: `{"inputs": [...]}` (at most 100), answered with the
        results in no promised order (shuffled here), each echoing what names its input."""
        import random

        inputs = body.get("inputs") if isinstance(body, dict) else None
        if not isinstance(inputs, list) or not 1 <= len(inputs) <= 100:
            return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "inputs: 1 to 100"}
        if action == "archive":  # `{"inputs": [{"id": ...}]}`, answered 204 without a body
            if not all(isinstance(one, dict) and isinstance(one.get("id"), str) for one in inputs):
                return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "inputs: {id}"}
            with self.vendors.lock:
                self.vendors.batch_calls.append((action, len(inputs)))
                for one in inputs:
                    self.vendors.hubspot.pop(one["id"], None)
            return 204, None
        for one in inputs:
            properties = one.get("properties") if isinstance(one, dict) else None
            if not isinstance(properties, dict) or not all(isinstance(x, str) for x in properties.values()):
                return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "properties: strings"}
        v = self.vendors
        results = []
        with v.lock:
            v.batch_calls.append((action, len(inputs)))
            for one in inputs:
                if action == "create":
                    if not isinstance(one.get("associations"), list):
                        return 400, {"status": "error", "category": "VALIDATION_ERROR", "message": "associations"}
                    new = v.new_id()
                    v.hubspot[new] = {"id": new, "properties": dict(one["properties"]), "archived": False}
                    results.append({**v.hubspot[new], "objectWriteTraceId": one.get("objectWriteTraceId")})
                elif action == "update":
                    found = v.hubspot.get(str(one.get("id")))
                    if found is None:
                        continue  # HubSpot leaves it out of the results (an error in a 207)
                    found["properties"].update(one["properties"])
                    results.append(dict(found))
                else:
                    return 404, {"status": "error", "message": "unknown batch action"}
        random.shuffle(results)
        answer = {"status": "COMPLETE", "results": results, "startedAt": "x", "completedAt": "y"}
        return (201 if action == "create" else 200), answer

    def _salesforce(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        if not self._bearer_ok(headers):
            return 401, [{"message": "Session expired or invalid", "errorCode": "INVALID_SESSION_ID"}]
        prefix = "/services/data/v60.0/sobjects/Contact/"
        if path.startswith(prefix) and self.command == "DELETE":
            with self.vendors.lock:
                gone = self.vendors.salesforce.pop(unquote(path.removeprefix(prefix)), None)
            return (204, None) if gone is not None else (404, [{"message": "not found", "errorCode": "NOT_FOUND"}])
        if not path.startswith(prefix) or self.command != "PATCH" or not isinstance(body, dict):
            return 404, [{"message": "The requested resource does not exist", "errorCode": "NOT_FOUND"}]
        if "LastName" not in body:
            return 400, [{"message": "Required fields are missing: [LastName]", "errorCode": "REQUIRED_FIELD_MISSING"}]
        rest = path.removeprefix(prefix).split("/")
        v = self.vendors
        with v.lock:
            if len(rest) == 2 and rest[0] == "External_Id__c":
                key = unquote(rest[1])
                for record_id, record in v.salesforce.items():
                    if record.get("External_Id__c") == key:
                        record.update(body)
                        return 200, {"id": record_id, "success": True, "errors": [], "created": False}
                new = "003" + v.new_id()
                v.salesforce[new] = {**body, "External_Id__c": key}
                return 201, {"id": new, "success": True, "errors": [], "created": True}
            if len(rest) == 1 and unquote(rest[0]) in v.salesforce:
                v.salesforce[unquote(rest[0])].update(body)
                return 204, None
        return 404, [{"message": "not found", "errorCode": "NOT_FOUND"}]

    def _intercom(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        if headers.get("authorization") != f"Bearer {API_KEY}":
            return 401, {"type": "error.list", "errors": [{"code": "unauthorized", "message": "Access Token Invalid"}]}
        if headers.get("intercom-version") != "2.11":
            return 400, {"type": "error.list", "errors": [{"code": "intercom_version_invalid"}]}
        parts = path.split("/")
        if len(parts) == 3 and self.command == "DELETE":
            with self.vendors.lock:
                gone = self.vendors.intercom.pop(unquote(parts[2]), None)
            if gone is None:
                return 404, {"type": "error.list", "errors": [{"code": "not_found"}]}
            return 200, {"id": gone["id"], "object": "contact", "deleted": True}
        if not isinstance(body, dict):
            return 400, {"type": "error.list", "errors": [{"code": "parameter_invalid"}]}
        v = self.vendors
        parts = path.split("/")
        with v.lock:
            if path == "/contacts" and self.command == "POST":
                if body.get("role") not in ("user", "lead"):
                    return 400, {"type": "error.list", "errors": [{"code": "parameter_invalid", "message": "role"}]}
                new = "ic" + v.new_id()
                v.intercom[new] = {"type": "contact", "id": new, **body}
                return 200, v.intercom[new]
            if len(parts) == 3 and self.command == "PUT" and unquote(parts[2]) in v.intercom:
                v.intercom[unquote(parts[2])].update(body)
                return 200, v.intercom[unquote(parts[2])]
        return 404, {"type": "error.list", "errors": [{"code": "not_found"}]}

    def _zendesk(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        expected = "Basic " + base64.b64encode(f"{ZENDESK_USER}:{ZENDESK_TOKEN}".encode()).decode()
        if headers.get("authorization") != expected:
            return 401, {"error": "Couldn't authenticate you"}
        user = body.get("user") if isinstance(body, dict) else None
        if not isinstance(user, dict):
            return 422, {"error": "RecordInvalid", "description": "user is required"}
        v = self.vendors
        parts = path.split("/")
        with v.lock:
            if path == "/api/v2/users" and self.command == "POST":
                new = int(v.new_id())
                v.zendesk[str(new)] = {"id": new, **user}
                return 201, {"user": v.zendesk[str(new)]}
            if len(parts) == 5 and self.command == "PUT" and parts[4] in v.zendesk:
                v.zendesk[parts[4]].update(user)
                return 200, {"user": v.zendesk[parts[4]]}
        return 404, {"error": "RecordNotFound"}

    def _reply(self, code: int, payload: Any) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(code)
        if data:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)
