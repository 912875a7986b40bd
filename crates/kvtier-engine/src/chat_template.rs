//! Chat templates: a conversation (`messages`) rendered into the prompt text the model was
//! trained on, by the Jinja template in the model directory's `tokenizer_config.json`
//! (`chat_template`), or — for presets and directories without one — ChatML, the format of the
//! Qwen family the presets are shaped after.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// The template presets use: ChatML, as Qwen's (without tools).
pub const DEFAULT_TEMPLATE: &str = "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// One message of a conversation, its content as text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or another role the template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

/// A compiled chat template and the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where it came from, for logs and `/v1/models`.
    source: &'static str,
}

/// `bos_token` / `eos_token` in tokenizer_config.json: a string or `{"content": …}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(m)) => m
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The model directory's template (`tokenizer_config.json`'s `chat_template`: a string, or
    /// a list of named templates of which `default` is used), else [`DEFAULT_TEMPLATE`].
    ///
    /// Cost: reads and compiles the template once.
    ///
    /// # Errors
    /// [`EngineError::Config`] for an unreadable config or a template that does not compile.
    pub fn for_model_dir(dir: Option<&Path>) -> Result<Self, EngineError> {
        let Some(path) = dir
            .map(|d| d.join("tokenizer_config.json"))
            .filter(|p| p.exists())
        else {
            return Self::new(
                DEFAULT_TEMPLATE.to_owned(),
                String::new(),
                String::new(),
                "chatml (default)",
            );
        };
        let err = |e: String| EngineError::Config(format!("{}: {e}", path.display()));
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let template = match v.get("chat_template") {
            Some(serde_json::Value::String(t)) => t.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| err("chat_template lists no template named default".into()))?
                .to_owned(),
            _ => {
                return Self::new(
                    DEFAULT_TEMPLATE.to_owned(),
                    String::new(),
                    String::new(),
                    "chatml (default)",
                );
            }
        };
        Self::new(
            template,
            token_text(v.get("bos_token")),
            token_text(v.get("eos_token")),
            "tokenizer_config.json",
        )
    }

    /// Compiles `template`.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a template that does not compile.
    pub fn new(
        template: String,
        bos_token: String,
        eos_token: String,
        source: &'static str,
    ) -> Result<Self, EngineError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", template)
            .map_err(|e| EngineError::Config(format!("chat template: {e}")))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            source,
        })
    }

    /// Where the template came from.
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// The prompt text of `messages`, ending with the assistant's turn opened.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] for a conversation the template refuses (its
    /// `raise_exception`, say) or cannot render.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Config(format!("chat template: {e}")))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| EngineError::BadRequest(format!("messages: the chat template refused them: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<ChatMessage> {
        v.iter()
            .map(|(r, c)| ChatMessage {
                role: (*r).into(),
                content: (*c).into(),
            })
            .collect()
    }

    #[test]
    fn the_default_is_chatml() {
        let t = ChatTemplate::for_model_dir(None).unwrap();
        assert_eq!(
            t.render(&msgs(&[("system", "Be brief."), ("user", "hi")]))
                .unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_hugging_face_template_renders_with_python_methods_namespace_and_exceptions() {
        let dir = tempfile::tempdir().unwrap();
        // The constructs real templates use (Qwen's, Llama's): namespace(), loop variables,
        // Python string methods, raise_exception and the special tokens.
        let template = r#"{{- bos_token }}{%- set ns = namespace(system=false) %}{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = true %}{%- endif %}{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{%- endif %}[{{ m.role | upper }}] {{ m.content.strip() }}{% if m.content.startswith('!') %} (loud){% endif %}{% if not loop.last %}|{% endif %}{%- endfor %}{%- if add_generation_prompt %}|[ASSISTANT]{% endif %}{{ ' sys' if ns.system else '' }}"#;
        let config = serde_json::json!({
            "chat_template": template,
            "bos_token": {"content": "<s>"},
            "eos_token": "</s>",
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::for_model_dir(Some(dir.path())).unwrap();
        assert_eq!(t.source(), "tokenizer_config.json");
        assert_eq!(
            t.render(&msgs(&[("system", "  rules "), ("user", "!hey")]))
                .unwrap(),
            "<s>[SYSTEM] rules|[USER] !hey (loud)|[ASSISTANT] sys"
        );
        let e = t.render(&msgs(&[("tool", "x")])).unwrap_err().to_string();
        assert!(e.contains("unknown role tool"), "{e}");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{% for %}"}"#,
        )
        .unwrap();
        assert!(ChatTemplate::for_model_dir(Some(dir.path())).is_err());
    }
}
