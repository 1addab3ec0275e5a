//! The command line: parses arguments and calls the library.
