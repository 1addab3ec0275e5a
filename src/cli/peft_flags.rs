//! TRL's PEFT flags, shared by `rloo sft` and `rloo reward train` (`rloo
//! train` maps the same names onto its `[peft]` keys).

use clap::Args;

use rloo::model::lora::PeftOptions;

fn d() -> PeftOptions {
    PeftOptions::default()
}

#[derive(Debug, Args)]
#[command(next_help_heading = "PEFT")]
pub struct PeftFlags {
    /// Train LoRA adapters (saved in PEFT's format) instead of the whole model.
    #[arg(long = "use_peft", alias = "use-peft")]
    use_peft: bool,
    /// LoRA rank.
    #[arg(long = "lora_r", alias = "lora-r", default_value_t = d().lora_r)]
    lora_r: usize,
    /// LoRA alpha (adapters scaled by alpha / r).
    #[arg(long = "lora_alpha", alias = "lora-alpha", default_value_t = d().lora_alpha)]
    lora_alpha: f64,
    /// Dropout on the adapters' input while training.
    #[arg(long = "lora_dropout", alias = "lora-dropout", default_value_t = d().lora_dropout)]
    lora_dropout: f64,
    /// Modules that get adapters, e.g. q_proj v_proj, or all-linear [default: PEFT's for the architecture].
    #[arg(long = "lora_target_modules", alias = "lora-target-modules", num_args = 1..)]
    lora_target_modules: Option<Vec<String>>,
}

impl PeftFlags {
    pub fn options(&self) -> PeftOptions {
        PeftOptions {
            use_peft: self.use_peft,
            lora_r: self.lora_r,
            lora_alpha: self.lora_alpha,
            lora_dropout: self.lora_dropout,
            lora_target_modules: self.lora_target_modules.clone(),
        }
    }
}
