//! The few proxy-wasm ABI calls the filter makes itself. The SDK's wrappers
//! panic when the host answers anything but Ok (a header map that is not
//! there any more, a stream the client left), and its local-response wrapper
//! for HTTP cannot carry a gRPC status; these return the status instead.

use proxy_wasm::types::{BufferType, MapType, Status};

extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        details_data: *const u8,
        details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
    fn proxy_set_header_map_pairs(map_type: MapType, data: *const u8, size: usize) -> Status;
    fn proxy_add_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> Status;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        data: *const u8,
        data_size: usize,
    ) -> Status;
}

/// A header map as the ABI takes it: the pair count, each pair's two
/// lengths, then each name and value followed by a NUL.
pub fn serialize_pairs(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

fn ok(status: Status) -> Result<(), Status> {
    match status {
        Status::Ok => Ok(()),
        other => Err(other),
    }
}

/// `grpc_status`: -1 for none.
pub fn send_local_response(
    status: u32,
    details: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
    grpc_status: i32,
) -> Result<(), Status> {
    let headers = serialize_pairs(headers);
    // SAFETY: every pointer is to a live slice of the given length, read by
    // the host during the call only.
    ok(unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            grpc_status,
        )
    })
}

pub fn set_map(map: MapType, pairs: &[(&str, &[u8])]) -> Result<(), Status> {
    let data = serialize_pairs(pairs);
    // SAFETY: as above.
    ok(unsafe { proxy_set_header_map_pairs(map, data.as_ptr(), data.len()) })
}

pub fn add_value(map: MapType, name: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: as above.
    ok(unsafe {
        proxy_add_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Replaces (`Some`) or removes (`None`) a header.
pub fn set_value(map: MapType, name: &str, value: Option<&[u8]>) -> Result<(), Status> {
    // SAFETY: as above.
    ok(unsafe {
        match value {
            Some(v) => {
                proxy_replace_header_map_value(map, name.as_ptr(), name.len(), v.as_ptr(), v.len())
            }
            None => proxy_remove_header_map_value(map, name.as_ptr(), name.len()),
        }
    })
}

/// Replaces `size` bytes of the buffered body from its start with `data`.
pub fn set_buffer(buffer: BufferType, size: usize, data: &[u8]) -> Result<(), Status> {
    // SAFETY: as above.
    ok(unsafe { proxy_set_buffer_bytes(buffer, 0, size, data.as_ptr(), data.len()) })
}
