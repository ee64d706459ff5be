//! The fleet simulation: the promises of the book checked under seeded
//! random schedules, on the real Lua in a real redis-server at the test
//! clock, with virtual Envoys driving the filter's real pure cores (the
//! lease slot, the quota calendar, the batch packer). Each property's
//! reference model is written from the book's promise, not from the code.
//!
//! `make test` runs every property over `engine::DEFAULT_CASES` schedules
//! each; `make sim` (in .ci/run) many more. A violation prints the seed
//! that replays it and the schedule shrunk to a short one. The book's
//! Inside it → The simulation names each property and the promise it
//! proves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../support/mod.rs"]
mod support;

mod engine;
mod flight;
mod joined;
mod kinds;
mod lease;
mod quota;

#[test]
fn leases_never_hold_more_than_a_bucket_that_never_leased() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    lease::load(&mut con);
    engine::holds(&lease::PROPERTY, lease::schedules(), |s| {
        lease::run(&mut con, s)
    });
}

#[test]
fn joined_settlements_charge_what_each_alone_would() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    joined::load(&mut con);
    engine::holds(&joined::SETTLE_PROPERTY, joined::settle_schedules(), |s| {
        joined::run_settle(&mut con, s)
    });
}

#[test]
fn a_batch_decides_what_its_members_alone_would() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    joined::load(&mut con);
    engine::holds(&joined::BATCH_PROPERTY, joined::batch_schedules(), |s| {
        joined::run_batch(&mut con, s)
    });
}

#[test]
fn a_calendar_quota_admits_its_amount_per_window_on_any_clock() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    quota::load(&mut con);
    engine::holds(&quota::PROPERTY, quota::schedules(), |s| {
        quota::run(&mut con, s)
    });
}

#[test]
fn a_concurrency_limit_never_has_more_in_flight_than_its_maximum() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    flight::load(&mut con);
    engine::holds(&flight::CC_PROPERTY, flight::cc_schedules(), |s| {
        flight::run_cc(&mut con, s)
    });
}

#[test]
fn an_idempotency_key_runs_upstream_at_most_once() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    flight::load(&mut con);
    engine::holds(&flight::IDEM_PROPERTY, flight::idem_schedules(), |s| {
        flight::run_idem(&mut con, s)
    });
}

#[test]
fn every_kind_keeps_its_bound_over_every_interval() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    kinds::load(&mut con);
    engine::holds(&kinds::PROPERTY, kinds::schedules(), |s| {
        kinds::run(&mut con, s)
    });
}
