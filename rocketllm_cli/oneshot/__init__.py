"""`rocketllm generate` beyond its options: the prompt and pictures it is given, and the routes that answer it
elsewhere (a running server, a warm model). commands/generate.py parses the options and runs the local path."""
