"""API errors as the Kubernetes API reports them: a Status object with a code and a reason."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


def not_found(kind: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{kind} "{name}" not found')


def already_exists(kind: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{kind} "{name}" already exists')


def conflict(kind: str, name: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind} "{name}": '
                    "the object has been modified; please apply your changes to the latest version")


def invalid(kind: str, name: str, why: str) -> ApiError:
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {why}')


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)
