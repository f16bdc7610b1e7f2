// A CAF-free facade: its source file is CAF code.
#pragma once
struct Node;
