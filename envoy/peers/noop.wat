(module
  ;; A proxy-wasm HTTP filter that does nothing: every callback our filter
  ;; exports, each returning at once. Its cost in Envoy is the V8 floor a
  ;; wasm filter pays per request before doing any work.
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 1024))
  (func (export "_initialize"))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
    (local $p i32)
    ;; A bump allocator that starts over: the host asks for memory only
    ;; to hand over configuration at start, never kept.
    (if (i32.gt_u (i32.add (global.get $heap) (local.get $n)) (i32.const 131072))
      (then (global.set $heap (i32.const 1024))))
    (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $n)))
    (local.get $p))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_request_trailers") (param i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_response_body") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_response_trailers") (param i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_delete") (param i32)))
