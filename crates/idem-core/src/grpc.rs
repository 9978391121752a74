//! gRPC under the contract (docs/contract.md §14): its status codes, which of them are stored,
//! and the status each of idem's own refusals becomes.
//!
//! A gRPC call is an HTTP/2 `POST` whose `content-type` is `application/grpc` (or
//! `application/grpc+proto` and the like). Its outcome is not the HTTP status, which is `200`
//! for every call that reached the server, but the `grpc-status` field: in the trailers after
//! the response message, or in the headers of a response without a message ("trailers-only").

/// A gRPC status code, as carried by `grpc-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GrpcCode {
    /// `0`: success.
    Ok,
    /// `1`: the call was cancelled, usually by the caller.
    Cancelled,
    /// `2`: an error with no better code.
    Unknown,
    /// `3`: the caller sent an invalid argument.
    InvalidArgument,
    /// `4`: the deadline passed before the call finished.
    DeadlineExceeded,
    /// `5`: something asked for was not found.
    NotFound,
    /// `6`: something to be created exists already.
    AlreadyExists,
    /// `7`: the caller may not do this.
    PermissionDenied,
    /// `8`: a quota or a resource ran out.
    ResourceExhausted,
    /// `9`: the system is not in the state the call needs.
    FailedPrecondition,
    /// `10`: aborted by a concurrency conflict; retry at a higher level.
    Aborted,
    /// `11`: outside the valid range.
    OutOfRange,
    /// `12`: the method is not implemented.
    Unimplemented,
    /// `13`: an invariant of the server broke.
    Internal,
    /// `14`: the service is unavailable for now; a retry may succeed.
    Unavailable,
    /// `15`: unrecoverable data loss.
    DataLoss,
    /// `16`: the caller is not authenticated.
    Unauthenticated,
}

/// What a gRPC status means for the key of the call that ended with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcClass {
    /// A result, success or business error (`OK`, `INVALID_ARGUMENT` from the handler,
    /// `NOT_FOUND`, `ALREADY_EXISTS`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`): stored and
    /// replayed to every retry.
    Stored,
    /// Transient (`CANCELLED`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`,
    /// `UNAVAILABLE`), an authentication failure (`UNAUTHENTICATED`, `PERMISSION_DENIED`) or a
    /// method that does not exist (`UNIMPLEMENTED`): not stored, so a retry with the same key
    /// runs again, as an HTTP `429`, `401` or `404` is not stored.
    NotStored,
    /// The server failed (`UNKNOWN`, `INTERNAL`, `DATA_LOSS`): the rule for an HTTP `5xx` in
    /// each mode (transaction mode rolls back; lease mode leaves the outcome unknown).
    ServerError,
}

impl GrpcCode {
    const ALL: [GrpcCode; 17] = [
        Self::Ok,
        Self::Cancelled,
        Self::Unknown,
        Self::InvalidArgument,
        Self::DeadlineExceeded,
        Self::NotFound,
        Self::AlreadyExists,
        Self::PermissionDenied,
        Self::ResourceExhausted,
        Self::FailedPrecondition,
        Self::Aborted,
        Self::OutOfRange,
        Self::Unimplemented,
        Self::Internal,
        Self::Unavailable,
        Self::DataLoss,
        Self::Unauthenticated,
    ];

    /// The code of a `grpc-status` value (`b"0"` to `b"16"`); `None` for anything else.
    pub fn from_field(value: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        // "01" or "+1" are not codes a server sends.
        if text.len() > 1 && text.starts_with('0') || text.starts_with('+') {
            return None;
        }
        let n: usize = text.parse().ok()?;
        Self::ALL.get(n).copied()
    }

    /// The number, as `grpc-status` carries it.
    pub fn as_field(self) -> &'static str {
        const FIELDS: [&str; 17] = [
            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
            "16",
        ];
        FIELDS[self as usize]
    }

    /// The name the gRPC specification gives it (`ALREADY_EXISTS`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::Cancelled => "CANCELLED",
            Self::Unknown => "UNKNOWN",
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::NotFound => "NOT_FOUND",
            Self::AlreadyExists => "ALREADY_EXISTS",
            Self::PermissionDenied => "PERMISSION_DENIED",
            Self::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Self::FailedPrecondition => "FAILED_PRECONDITION",
            Self::Aborted => "ABORTED",
            Self::OutOfRange => "OUT_OF_RANGE",
            Self::Unimplemented => "UNIMPLEMENTED",
            Self::Internal => "INTERNAL",
            Self::Unavailable => "UNAVAILABLE",
            Self::DataLoss => "DATA_LOSS",
            Self::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// What a call that ended with this status means for its key (docs/contract.md §14).
    pub fn class(self) -> GrpcClass {
        match self {
            Self::Ok
            | Self::InvalidArgument
            | Self::NotFound
            | Self::AlreadyExists
            | Self::FailedPrecondition
            | Self::OutOfRange => GrpcClass::Stored,
            Self::Cancelled
            | Self::DeadlineExceeded
            | Self::ResourceExhausted
            | Self::Aborted
            | Self::Unavailable
            | Self::Unauthenticated
            | Self::PermissionDenied
            | Self::Unimplemented => GrpcClass::NotStored,
            Self::Unknown | Self::Internal | Self::DataLoss => GrpcClass::ServerError,
        }
    }
}

/// Whether a `content-type` value names a gRPC call: `application/grpc`, alone or followed by
/// `+` (a codec, `application/grpc+proto`) or `;` (parameters). Not gRPC-Web
/// (`application/grpc-web`), which carries its trailers in the body and is plain HTTP here.
pub fn is_grpc_content_type(value: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    value.len() >= GRPC.len()
        && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(value.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// Percent-encodes `message` for `grpc-message` as the gRPC protocol asks: bytes outside
/// printable ASCII, and `%` itself, as `%XX`.
pub fn grpc_message(message: &str) -> String {
    use std::fmt::Write as _;
    let mut encoded = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            encoded.push(byte as char);
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_reads_back_from_its_field_and_nothing_else_does() {
        for code in GrpcCode::ALL {
            assert_eq!(GrpcCode::from_field(code.as_field().as_bytes()), Some(code));
        }
        for bad in ["", "17", "-1", "01", "+1", " 1", "OK", "1.0"] {
            assert_eq!(GrpcCode::from_field(bad.as_bytes()), None, "{bad:?}");
        }
    }

    /// docs/contract.md §14: business results are stored, transient and auth failures are
    /// not, server errors follow the 5xx rule.
    #[test]
    fn each_status_has_the_class_of_the_contract() {
        use GrpcClass::*;
        let expected = [
            (GrpcCode::Ok, Stored),
            (GrpcCode::InvalidArgument, Stored),
            (GrpcCode::NotFound, Stored),
            (GrpcCode::AlreadyExists, Stored),
            (GrpcCode::FailedPrecondition, Stored),
            (GrpcCode::OutOfRange, Stored),
            (GrpcCode::Cancelled, NotStored),
            (GrpcCode::DeadlineExceeded, NotStored),
            (GrpcCode::ResourceExhausted, NotStored),
            (GrpcCode::Aborted, NotStored),
            (GrpcCode::Unavailable, NotStored),
            (GrpcCode::Unauthenticated, NotStored),
            (GrpcCode::PermissionDenied, NotStored),
            (GrpcCode::Unimplemented, NotStored),
            (GrpcCode::Unknown, ServerError),
            (GrpcCode::Internal, ServerError),
            (GrpcCode::DataLoss, ServerError),
        ];
        assert_eq!(expected.len(), GrpcCode::ALL.len());
        for (code, class) in expected {
            assert_eq!(code.class(), class, "{}", code.name());
        }
    }

    #[test]
    fn grpc_content_types_are_told_from_others() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC;charset=utf-8",
        ] {
            assert!(is_grpc_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/json",
            "application/grp",
            "",
        ] {
            assert!(!is_grpc_content_type(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn a_message_is_percent_encoded() {
        assert_eq!(grpc_message("in use: 100%"), "in use: 100%25");
        assert_eq!(grpc_message("é\n"), "%C3%A9%0A");
    }
}
