// Plain code under actors/: its source includes only this header.
#pragma once
int table_size();
