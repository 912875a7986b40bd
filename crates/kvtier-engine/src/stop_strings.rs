//! Stop strings: where generated text must end, found across token boundaries, and how much of
//! a stream can be sent before a stop string could still begin in it.

use std::sync::Arc;

use crate::request::StopCheck;

/// Token ids → text (the engine's codec).
pub type Decoder = dyn Fn(&[u32]) -> String + Send + Sync;

/// At most this many stop strings per request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// A request's stop strings (none empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStrings(Vec<String>);

impl StopStrings {
    /// Checks `stops`: at most [`MAX_STOP_STRINGS`], none empty.
    ///
    /// # Errors
    /// A message naming the problem, for a 400.
    pub fn new(stops: Vec<String>) -> Result<Self, String> {
        if stops.len() > MAX_STOP_STRINGS {
            return Err(format!(
                "stop: at most {MAX_STOP_STRINGS} sequences ({} given)",
                stops.len()
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err("stop: a stop sequence cannot be empty".into());
        }
        Ok(Self(stops))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Where the first stop string starts in `text`, if one occurs.
    pub fn find(&self, text: &str) -> Option<usize> {
        self.0.iter().filter_map(|s| text.find(s.as_str())).min()
    }

    /// `text` up to the first stop string (excluded), and whether one was found.
    pub fn truncate<'a>(&self, text: &'a str) -> (&'a str, bool) {
        match self.find(text) {
            Some(at) => (&text[..at], true),
            None => (text, false),
        }
    }

    /// How much of `text` (which holds no stop string) may be sent: all but its longest
    /// suffix that begins some stop string, which the next tokens could complete.
    pub fn sendable(&self, text: &str) -> usize {
        let mut keep = text.len();
        for s in &self.0 {
            for (i, _) in s.char_indices().skip(1) {
                if text.ends_with(&s[..i]) {
                    keep = keep.min(text.len() - i);
                }
            }
        }
        keep
    }

    /// The engine's per-token check: decodes only the tail of the output that a stop string
    /// ending at the newest token could span (each token is at least one byte), so the cost
    /// per token does not grow with the output.
    pub fn check(&self, codec: Arc<Decoder>) -> Option<StopCheck> {
        if self.is_empty() {
            return None;
        }
        let stops = self.clone();
        let window = self.0.iter().map(String::len).max().unwrap_or(0) + 8;
        Some(StopCheck(Arc::new(move |ids: &[u32]| {
            let tail = &ids[ids.len().saturating_sub(window)..];
            stops.find(&codec(tail)).is_some()
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> StopStrings {
        StopStrings::new(s.iter().map(|x| (*x).to_owned()).collect()).unwrap()
    }

    #[test]
    fn finds_truncates_and_holds_back_partial_matches() {
        let s = stops(&["\n\n", "END"]);
        assert_eq!(s.truncate("abc\n\ndef"), ("abc", true));
        assert_eq!(s.truncate("abcEN"), ("abcEN", false));
        assert_eq!(s.truncate("xENDy\n\n"), ("x", true));
        // "EN" may become "END": hold it back; "\n" may become "\n\n".
        assert_eq!(s.sendable("abcEN"), 3);
        assert_eq!(s.sendable("abc\n"), 3);
        assert_eq!(s.sendable("abcE"), 3);
        assert_eq!(s.sendable("abcX"), 4);
        let u = stops(&["ünd"]);
        assert_eq!(u.sendable("abü"), 2);
        assert_eq!(u.sendable("abün"), 2);
    }

    #[test]
    fn bad_stop_lists_are_refused() {
        assert!(StopStrings::new(vec![String::new()]).is_err());
        assert!(StopStrings::new(vec!["a".into(); 5]).is_err());
    }

    #[test]
    fn the_check_sees_a_stop_string_spanning_tokens() {
        // One byte per token.
        let codec: Arc<Decoder> = Arc::new(|ids: &[u32]| ids.iter().map(|&b| b as u8 as char).collect());
        let check = stops(&["END"]).check(codec).unwrap();
        let ids: Vec<u32> = "a long prefix that has no stop, then EN"
            .bytes()
            .map(u32::from)
            .collect();
        assert!(!(check.0)(&ids));
        let mut more = ids.clone();
        more.push(u32::from(b'D'));
        assert!((check.0)(&more));
        assert!(stops(&[]).check(Arc::new(|_: &[u32]| String::new())).is_none());
    }
}
