//! The token → owner table: which stage a callout's reply goes to. A stage
//! that sends a call notes its token here; the flow looks the reply's token
//! up and hands the reply to that stage. It sits below both, so a stage
//! never imports the flow that drives it.

/// The stage a callout's reply goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Decision,
    Record,
    Upload,
    Replay,
    /// A renewal of the request's concurrency slots.
    Slots,
}

/// Callouts in flight for this request: token -> owning stage. A request
/// has at most a few at once, so a short list beats a map.
#[derive(Debug, Default)]
pub struct Calls(Vec<(u32, Owner)>);

impl Calls {
    pub fn expect(&mut self, token: u32, owner: Owner) {
        self.0.push((token, owner));
    }

    pub fn owner(&self, token: u32) -> Option<Owner> {
        self.0.iter().find(|(t, _)| *t == token).map(|(_, o)| *o)
    }

    pub fn take(&mut self, token: u32) -> Option<Owner> {
        let i = self.0.iter().position(|(t, _)| *t == token)?;
        Some(self.0.swap_remove(i).1)
    }
}
