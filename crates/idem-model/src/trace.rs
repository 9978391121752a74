//! Counterexamples, printed so a person can follow them: one line per step, what changed under
//! it.

use std::fmt::Write as _;

use stateright::Path;

use crate::config::BODIES;
use crate::model::{Action, IdemModel};
use crate::world::{Call, Final, Outcome, Phase, Rec, RecState, Recon, Req, Resp, World};

/// A client's name, after the body it sends: A, A' (the same request written another way),
/// B (another request).
fn client(m: &IdemModel, c: u8) -> &'static str {
    ["A", "A'", "B"][usize::from(m.body_of(c))]
}

fn resp(r: Resp) -> String {
    match r {
        Resp::Charge { n, class } => {
            format!("201 (charge #{n} for {})", BODIES[usize::from(class)])
        }
        Resp::Row { n, class } => format!("201 (row #{n} for {})", BODIES[usize::from(class)]),
    }
}

fn record(r: &Option<Rec>) -> String {
    match r {
        None => "none".into(),
        Some(rec) => {
            let state = match rec.state {
                RecState::InProgress { lease_until, token } => {
                    format!("in_progress token {token} lease_until {lease_until}s")
                }
                RecState::Completed(r) => format!("completed {}", resp(r)),
            };
            format!(
                "{state}, body {}, expires {}s",
                BODIES[usize::from(rec.body)],
                rec.expires
            )
        }
    }
}

fn phase(m: &IdemModel, p: &Phase) -> String {
    let held = |h: &crate::world::Held| {
        format!(
            "client {} attempt {}, token {}{}",
            client(m, h.req.client),
            h.req.attempt,
            h.token,
            if h.slow { ", stalled" } else { "" }
        )
    };
    match p {
        Phase::Idle => "idle".into(),
        Phase::Read(r) => format!(
            "read next (client {} attempt {})",
            client(m, r.client),
            r.attempt
        ),
        Phase::Claim(r) => format!(
            "claim next (client {} attempt {})",
            client(m, r.client),
            r.attempt
        ),
        Phase::ClaimWrite(r) => format!(
            "claim's write next (client {} attempt {})",
            client(m, r.client),
            r.attempt
        ),
        Phase::Claimed(h) => format!("claimed ({}), call next", held(h)),
        Phase::Calling(h, Call::Pending { deadline }) => {
            format!("calling ({}), call times out at {deadline}s", held(h))
        }
        Phase::Calling(h, Call::Lost { deadline }) => format!(
            "calling ({}), answer lost, call times out at {deadline}s",
            held(h)
        ),
        Phase::Returned(h, o) => {
            let o = match o {
                Outcome::Store(r) => format!("store {}", resp(*r)),
                Outcome::Release => "release".into(),
                Outcome::Unknown => "outcome unknown".into(),
            };
            format!("work returned ({}): {o} next", held(h))
        }
        Phase::TxBegin(r) => format!(
            "begin_claim next (client {} attempt {})",
            client(m, r.client),
            r.attempt
        ),
        Phase::InTx { req, .. } => format!(
            "in transaction (client {} attempt {})",
            client(m, req.client),
            req.attempt
        ),
    }
}

fn answer(a: &Option<Final>) -> String {
    match a {
        None => "no answer".into(),
        Some(Final::Stored { resp: r, epoch }) => format!("got {} (epoch {epoch})", resp(*r)),
        Some(Final::Mismatch) => "got 422 mismatch".into(),
    }
}

/// What one action is, in words.
pub fn describe(m: &IdemModel, action: &Action) -> String {
    match *action {
        Action::Tick => "the clock advances".into(),
        Action::Send {
            client: c,
            instance,
        } => format!(
            "client {} sends {} to instance {instance}",
            client(m, c),
            BODIES[usize::from(m.body_of(c))]
        ),
        Action::Read(i) => format!("instance {i} reads the record (replay read)"),
        Action::Claim(i) => format!("instance {i} claims the key"),
        Action::ClaimLost(i) => {
            format!("instance {i} claims the key, the answer is lost (FAULT): 503")
        }
        Action::ClaimWrite(i) => format!("instance {i} writes its claim"),
        Action::Call(i) => format!("instance {i} calls the downstream with the key"),
        Action::Renew(i) => format!("instance {i} renews its lease"),
        Action::Stall(i) => format!("instance {i} stalls (FAULT): its renewals stop"),
        Action::Answer(i) => format!("the downstream acts on instance {i}'s call and answers"),
        Action::AnswerLost(i) => {
            format!("the downstream acts on instance {i}'s call, its answer is lost (FAULT)")
        }
        Action::Fail(i) => format!("the downstream answers instance {i} 5xx (FAULT)"),
        Action::Refuse(i) => format!("instance {i}'s connection is refused (FAULT)"),
        Action::Timeout(i) => format!("instance {i}'s call times out"),
        Action::Store(i) => format!("instance {i} stores the outcome and answers"),
        Action::StoreFails(i) => format!(
            "instance {i}'s completion fails (FAULT): it answers, and retries in the background"
        ),
        Action::RetryStore(i) => format!("instance {i} retries the completion"),
        Action::RetryGiveUp(i) => format!("instance {i} gives up retrying the completion"),
        Action::Orphan(k) => format!("the downstream acts on orphaned call {k}"),
        Action::Crash(i) => format!("instance {i} crashes (FAULT)"),
        Action::TxBegin(i) => format!("instance {i} opens a transaction and claims the key"),
        Action::TxBusy(i) => format!("instance {i}'s wait for the key runs out: 409"),
        Action::TxCommit(i) => format!("instance {i} commits the row, the key and the response"),
        Action::TxRollback(i) => format!("instance {i}'s transaction rolls back (FAULT)"),
        Action::Sweep => "the sweeper deletes the expired record".into(),
        Action::ReconList => "the reconciler lists the stale record".into(),
        Action::ReconLookup => "the reconciler asks the downstream by key".into(),
        Action::ReconLookupFails => "the reconciler cannot reach the downstream (FAULT)".into(),
        Action::ReconResolve => "the reconciler resolves the record".into(),
    }
}

/// What changed from `a` to `b`, one item per part.
fn changes(m: &IdemModel, a: &World, b: &World) -> Vec<String> {
    let mut out = Vec::new();
    if a.record != b.record {
        out.push(format!("record: {}", record(&b.record)));
    }
    for i in 0..2 {
        if a.instances[i].phase != b.instances[i].phase {
            out.push(format!("instance {i}: {}", phase(m, &b.instances[i].phase)));
        }
        if a.instances[i].retry != b.instances[i].retry {
            let retry = match b.instances[i].retry {
                Some(r) => format!("retrying {} until {}s", resp(r.resp), r.give_up),
                None => "no retry".into(),
            };
            out.push(format!("instance {i}: {retry}"));
        }
    }
    for c in 0..m.config.clients.len() {
        if a.clients[c].answer != b.clients[c].answer {
            out.push(format!(
                "client {}: {}",
                client(m, c as u8),
                answer(&b.clients[c].answer)
            ));
        }
    }
    if a.effects != b.effects || a.made != b.made {
        out.push(format!(
            "EFFECTS this epoch: {} (made in all: {})",
            b.effects, b.made
        ));
    }
    if a.orphans != b.orphans {
        let list: Vec<_> = b
            .orphans
            .iter()
            .flatten()
            .map(|o| format!("{}s", o.deadline))
            .collect();
        out.push(format!(
            "orphaned calls (timing out at): [{}]",
            list.join(", ")
        ));
    }
    if a.recon != b.recon {
        out.push(match b.recon {
            Recon::Idle => "reconciler: idle".into(),
            Recon::Listed { token } => format!("reconciler: listed token {token}"),
            Recon::Looked { token, charge } => format!(
                "reconciler: token {token}, downstream says {}",
                charge.map_or("404".to_string(), resp)
            ),
        });
    }
    if a.epoch != b.epoch {
        out.push(format!("epoch {} (the key is new again)", b.epoch));
    }
    if a.fence_broken != b.fence_broken {
        out.push("FENCING BROKEN: an old token wrote".into());
    }
    out
}

/// The request an instance is about to decide on, if it is about to.
fn deciding(w: &World, action: &Action) -> Option<Req> {
    let i = match *action {
        Action::Read(i) | Action::Claim(i) | Action::ClaimLost(i) | Action::TxBegin(i) => i,
        _ => return None,
    };
    match w.instances[usize::from(i)].phase {
        Phase::Read(req) | Phase::Claim(req) | Phase::TxBegin(req) => Some(req),
        _ => None,
    }
}

/// The counterexample `path`, one numbered step a line, with what `decide` said where an
/// instance decided, and what each step changed.
pub fn render(model: &IdemModel, path: &Path<World, Action>) -> String {
    let mut out = String::new();
    let steps = path.clone().into_vec();
    let mut n = 0;
    for (k, (state, action)) in steps.iter().enumerate() {
        let Some(action) = action else { break };
        n += 1;
        let mut line = format!("  {n:>2}. [t={}s] {}", state.now, describe(model, action));
        if *action == Action::Tick {
            line = format!(
                "  {n:>2}. [t={}s] the clock advances to {}s",
                state.now,
                state.now + 1
            );
        }
        if let Some(req) = deciding(state, action) {
            let body = model.body_of(req.client);
            let dec = model.decide(state.record.as_ref(), body, state.now);
            let _ = write!(line, " (decide: {dec:?})");
        }
        let _ = writeln!(out, "{line}");
        if let Some((next, _)) = steps.get(k + 1) {
            let changed = changes(model, state, next);
            if !changed.is_empty() {
                let _ = writeln!(out, "        {}", changed.join("; "));
            }
        }
    }
    let end = path.last_state();
    let _ = writeln!(
        out,
        "  end: t={}s, record: {}, effects this epoch: {}",
        end.now,
        record(&end.record),
        end.effects
    );
    out
}
