//! A prompt as a dataset row holds it: plain text, or a conversation of
//! `{role, content}` messages (the TRL "conversational" format) that a chat
//! template turns into text.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One chat message. Only `role` and `content` reach the chat template;
/// other keys of a dataset's message objects are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ... as the chat template expects.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl Message {
    /// A message from its role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

/// What the policy is asked to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Tokenised as is.
    Text(String),
    /// Rendered with the model's chat template first.
    Messages(Vec<Message>),
}

impl Prompt {
    /// Reads a dataset cell: a string is text, an array of `{role, content}`
    /// objects is a conversation. The error says what was expected and what
    /// was found, for the caller to prefix with the file, row and column.
    pub fn from_value(value: &Value) -> std::result::Result<Prompt, String> {
        match value {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(items) if items.is_empty() => {
                Err("expected a string or a non-empty list of {role, content} messages, \
                     got an empty list"
                    .to_string())
            }
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| message_from_value(item).map_err(|e| format!("message {i}: {e}")))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Prompt::Messages),
            other => {
                Err(format!("expected a string or a list of {{role, content}} messages, got {}", describe_json(other)))
            }
        }
    }
}

fn message_from_value(value: &Value) -> std::result::Result<Message, String> {
    let Value::Object(map) = value else {
        return Err(format!(
            "expected an object with string fields \"role\" and \"content\", got {}",
            describe_json(value)
        ));
    };
    let field = |name: &str| match map.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("\"{name}\" must be a string, got {}", describe_json(other))),
        None => Err(format!(
            "missing \"{name}\" (keys present: {})",
            map.keys().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", ")
        )),
    };
    Ok(Message { role: field("role")?, content: field("content")? })
}

/// A short description of a JSON value for error messages:
/// `a number (3)`, `an object with keys "a", "b"`, `a string ("abc...")`.
pub fn describe_json(value: &Value) -> String {
    fn clip(s: &str) -> String {
        const MAX: usize = 40;
        if s.chars().count() <= MAX {
            s.to_string()
        } else {
            format!("{}...", s.chars().take(MAX).collect::<String>())
        }
    }
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("a boolean ({b})"),
        Value::Number(n) => format!("a number ({n})"),
        Value::String(s) => format!("a string ({:?})", clip(s)),
        Value::Array(a) => format!("a list of {} items", a.len()),
        Value::Object(m) if m.is_empty() => "an empty object".to_string(),
        Value::Object(m) => format!(
            "an object with keys {}",
            clip(&m.keys().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", "))
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn string_is_text() {
        assert_eq!(Prompt::from_value(&json!("hi")).unwrap(), Prompt::Text("hi".into()));
    }

    #[test]
    fn list_of_role_content_objects_is_messages_and_extra_keys_are_ignored() {
        let v = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi", "name": "bob"}
        ]);
        assert_eq!(
            Prompt::from_value(&v).unwrap(),
            Prompt::Messages(vec![Message::new("system", "be brief"), Message::new("user", "hi")])
        );
    }

    #[test]
    fn other_shapes_say_what_was_expected_and_found() {
        assert_eq!(
            Prompt::from_value(&json!(3)).unwrap_err(),
            "expected a string or a list of {role, content} messages, got a number (3)"
        );
        assert_eq!(
            Prompt::from_value(&json!([])).unwrap_err(),
            "expected a string or a non-empty list of {role, content} messages, got an empty list"
        );
        assert_eq!(
            Prompt::from_value(&json!([{"role": "user"}])).unwrap_err(),
            "message 0: missing \"content\" (keys present: \"role\")"
        );
        assert_eq!(
            Prompt::from_value(&json!([{"role": "user", "content": "a"}, "b"])).unwrap_err(),
            "message 1: expected an object with string fields \"role\" and \"content\", got a string (\"b\")"
        );
        assert_eq!(
            Prompt::from_value(&json!([{"role": "user", "content": [1]}])).unwrap_err(),
            "message 0: \"content\" must be a string, got a list of 1 items"
        );
    }

    #[test]
    fn message_serialises_as_role_and_content() {
        let m = Message::new("user", "hi");
        assert_eq!(serde_json::to_value(&m).unwrap(), json!({"role": "user", "content": "hi"}));
    }
}
