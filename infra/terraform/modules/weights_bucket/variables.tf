variable "bucket" {
  description = "Name of the bucket."
  type        = string
}

variable "weights_prefix" {
  description = "Key prefix the weightstore writes under, with its trailing slash."
  type        = string
}

variable "noncurrent_version_days" {
  description = "Days a replaced or deleted object stays as a noncurrent version."
  type        = number
}
