//! Built-in tasks that need no downloaded data, and what they need to run
//! from scratch (a tokenizer trained on their text).

pub mod movie_reviews;
pub mod tokenizer;
