"""The worker's API errors, in the contract's shape `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request", code: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code or type_

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, "invalid_request", code)


def conflict(message: str, code: str) -> ApiError:
    return ApiError(409, message, "conflict", code)


def not_found(message: str) -> ApiError:
    return ApiError(404, message, "not_found", "unknown_request")
